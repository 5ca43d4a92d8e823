"""Drop-in modules: the torch modules they replace, with ampkernels' forward.

    LayerNorm, RMSNorm      subclasses of torch.nn.LayerNorm / RMSNorm (same state_dict)
    OffsetRMSNorm           RMSNorm scaled by (1 + weight), Gemma's
    Linear                  a torch.nn.Linear with a fused activation
    FusedMLP                a Sequential(Linear, activation, Linear) with a fused forward
    FusedGatedMLP           LlamaMLP's gate_proj/up_proj/down_proj with a fused gated forward
    FusedSwiGLU, FusedGluMlp  timm's SwiGLU / GluMlp (their state_dict keys), fused
    FusedT5GatedDense       Hugging Face's T5DenseGatedActDense (its state_dict keys), the gated part fused
    FusedPackedGatedMLP     Phi-3's / GLM's gate_up_proj + down_proj gated MLP (their state_dict keys), fused
    FusedResidualBlocks     timm ViT's Sequential of Blocks, each residual add inside the next norm
    FusedPostNormResidual   BERT's output sublayers (dense, dropout, LayerNorm of the sum), the add in the norm
    LinearCrossEntropy      an nn.Linear LM head whose forward(x, target) is the loss (no logits)
    convert(model)          swaps norms and Linear->activation pairs in place, sharing weights
"""
from .convert import ConvertReport, convert
from .modules import (FusedGatedMLP, FusedGluMlp, FusedMLP, FusedPackedGatedMLP, FusedPostNormResidual,
                      FusedResidualBlocks, FusedSwiGLU, FusedT5GatedDense, LayerNorm, Linear, LinearCrossEntropy,
                      OffsetRMSNorm, RMSNorm)

__all__ = ["LayerNorm", "RMSNorm", "OffsetRMSNorm", "Linear", "FusedMLP", "FusedGatedMLP", "FusedSwiGLU", "FusedGluMlp",
           "FusedT5GatedDense", "FusedPackedGatedMLP", "FusedResidualBlocks", "FusedPostNormResidual",
           "LinearCrossEntropy", "convert", "ConvertReport"]
