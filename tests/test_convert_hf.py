"""convert() on Hugging Face models: BERT, GPT-2, LLaMA, Qwen2, Phi-3, T5 (and T5 v1.1's gated MLP),
Gemma, the non-gated MLPs (GPT-NeoX, Falcon, Phi, CodeGen, GPT-J, GPT-Neo, and ViT, SigLIP,
Starcoder2, GPT-BigCode by structure): outputs and five training steps against the unconverted model, what is left alone and
why, and checkpoints (state_dict both ways, save_pretrained / from_pretrained)."""
import copy

import pytest
import torch

import ampkernels.nn as aknn
from tests.utils import assert_rel_close

transformers = pytest.importorskip("transformers")
T = transformers
V = 100  # vocabulary of the tiny configs


def _configs():
    small = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    return {
        "t5": (T.T5ForConditionalGeneration, T.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                       num_heads=4, feed_forward_proj="relu", dropout_rate=0.0)),
        "t5_gated": (T.T5ForConditionalGeneration, T.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                             num_heads=4, feed_forward_proj="gated-gelu",
                                                             dropout_rate=0.0)),
        "gemma": (T.GemmaForCausalLM, T.GemmaConfig(intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                                                    head_dim=16, **small)),
        "gpt_neox": (T.GPTNeoXForCausalLM, T.GPTNeoXConfig(intermediate_size=128, num_hidden_layers=2,
                                                           hidden_act="gelu", **small)),
        "falcon": (T.FalconForCausalLM, T.FalconConfig(vocab_size=V, hidden_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, new_decoder_architecture=False,
                                                       multi_query=True, bias=True)),
        "phi": (T.PhiForCausalLM, T.PhiConfig(intermediate_size=128, num_hidden_layers=2, hidden_act="gelu_new",
                                              resid_pdrop=0.0, embd_pdrop=0.0, **small)),
        "codegen": (T.CodeGenForCausalLM, T.CodeGenConfig(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                          rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0)),
        "gptj": (T.GPTJForCausalLM, T.GPTJConfig(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                 rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0)),
        "gpt_neo": (T.GPTNeoForCausalLM, T.GPTNeoConfig(vocab_size=V, hidden_size=64, num_layers=2, num_heads=4,
                                                        attention_types=[[["global", "local"], 1]],
                                                        max_position_embeddings=64, resid_dropout=0.0,
                                                        embed_dropout=0.0)),
        "bert": (T.BertForMaskedLM, T.BertConfig(intermediate_size=128, num_hidden_layers=2, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0, **small)),
        "gpt2": (T.GPT2LMHeadModel, T.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": (T.LlamaForCausalLM, T.LlamaConfig(intermediate_size=160, num_hidden_layers=2, num_key_value_heads=2,
                                                    **small)),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(intermediate_size=160, num_hidden_layers=2, num_key_value_heads=2,
                                                    **small)),
        "phi3": (T.Phi3ForCausalLM, T.Phi3Config(intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2,
                                                 pad_token_id=0, **small)),
        "starcoder2": (T.Starcoder2ForCausalLM, T.Starcoder2Config(intermediate_size=128, num_hidden_layers=2,
                                                                   num_key_value_heads=2, **small)),
        "gpt_bigcode": (T.GPTBigCodeForCausalLM, T.GPTBigCodeConfig(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                                                    n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                                    attn_pdrop=0.0)),
        "vit": (T.ViTForImageClassification, T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                          intermediate_size=128, image_size=32, patch_size=8,
                                                          num_labels=10)),
        "siglip": (T.SiglipVisionModel, T.SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                            num_attention_heads=4, image_size=32, patch_size=8)),
    }


EXPECTED = {  # (old class, new class, fused activation) -> count, for the 2-layer configs above
    "t5": {("T5LayerNorm", "RMSNorm", None): 12, ("Linear", "Linear", "relu"): 4},  # enc 2x2+1, dec 2x3+1
    "t5_gated": {("T5LayerNorm", "RMSNorm", None): 12, ("T5DenseGatedActDense", "FusedT5GatedDense", "gelu_tanh"): 4},
    "gemma": {("GemmaRMSNorm", "OffsetRMSNorm", None): 5, ("GemmaMLP", "FusedGatedMLP", "gelu_tanh"): 2},
    "gpt_neox": {("LayerNorm", "LayerNorm", None): 5, ("Linear", "Linear", "gelu"): 2},
    "falcon": {("LayerNorm", "LayerNorm", None): 3, ("FalconLinear", "Linear", "gelu"): 2},
    "phi": {("LayerNorm", "LayerNorm", None): 3, ("Linear", "Linear", "gelu_tanh"): 2},
    "codegen": {("LayerNorm", "LayerNorm", None): 3, ("Linear", "Linear", "gelu_tanh"): 2},
    "gptj": {("LayerNorm", "LayerNorm", None): 3, ("Linear", "Linear", "gelu_tanh"): 2},
    "gpt_neo": {("LayerNorm", "LayerNorm", None): 5, ("Linear", "Linear", "gelu_tanh"): 2},
    "bert": {("LayerNorm", "LayerNorm", None): 6, ("Linear", "Linear", "gelu"): 3,  # + the MLM head's
             ("BertSelfOutput", "FusedPostNormResidual", None): 2, ("BertOutput", "FusedPostNormResidual", None): 2},
    "gpt2": {("LayerNorm", "LayerNorm", None): 5, ("Conv1D", "Conv1DAct", "gelu_tanh"): 2},
    "llama": {("LlamaRMSNorm", "RMSNorm", None): 5, ("LlamaMLP", "FusedGatedMLP", "silu"): 2},
    "qwen2": {("Qwen2RMSNorm", "RMSNorm", None): 5, ("Qwen2MLP", "FusedGatedMLP", "silu"): 2},
    "phi3": {("Phi3RMSNorm", "RMSNorm", None): 5, ("Phi3MLP", "FusedPackedGatedMLP", "silu"): 2},
    "starcoder2": {("LayerNorm", "LayerNorm", None): 5, ("Linear", "Linear", "gelu_tanh"): 2},
    "gpt_bigcode": {("LayerNorm", "LayerNorm", None): 5, ("Linear", "Linear", "gelu_tanh"): 2},
    "vit": {("LayerNorm", "LayerNorm", None): 5, ("Linear", "Linear", "gelu"): 2},  # 2 per layer + final
    # 2 per layer + post_layernorm + the pooling head's norm; the MLP per layer + the head's
    "siglip": {("LayerNorm", "LayerNorm", None): 6, ("Linear", "Linear", "gelu_tanh"): 3},
}


def _build(name):
    cls, cfg = _configs()[name]
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # norms at init are ones (zeros for Gemma): random, so that a wrong scale shows
        for n, p in model.named_parameters():
            if p.dim() == 1 and "norm" in n.lower():
                p.normal_(0.0, 0.5)
    return model


def _logits(model, ids):
    if model.main_input_name == "pixel_values":  # vision models: an image made of the ids
        out = model(pixel_values=_pixels(ids))
        return out.logits if hasattr(out, "logits") else out.last_hidden_state
    if model.config.is_encoder_decoder:
        return model(input_ids=ids, decoder_input_ids=ids).logits
    return model(input_ids=ids).logits


def _pixels(ids):
    g = torch.Generator().manual_seed(int(ids.sum()))
    return torch.randn(ids.shape[0], 3, 32, 32, generator=g)


def _loss(model, ids):
    """A training loss for each kind of model: the LM loss on ids, or for a vision model a
    class label (ViT) or the mean square of the features."""
    if model.main_input_name == "pixel_values":
        if hasattr(model, "classifier"):
            return model(pixel_values=_pixels(ids), labels=ids[:, 0] % model.config.num_labels).loss
        return model(pixel_values=_pixels(ids)).last_hidden_state.square().mean()
    if model.config.is_encoder_decoder:
        return model(input_ids=ids, decoder_input_ids=ids, labels=ids).loss
    return model(input_ids=ids, labels=ids).loss


def _counts(report):
    out = {}
    for d, (_, old, new) in zip(report.details, report.replaced):
        key = (old, new, d.activation)
        out[key] = out.get(key, 0) + 1
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_convert_outputs_match(name):
    ref = _build(name)
    model = copy.deepcopy(ref)
    params_before = {id(p) for p in model.parameters()}
    _, report = aknn.convert(model)
    assert _counts(report) == EXPECTED[name], str(report)
    lines = str(report).splitlines()
    assert lines[0] == f"ampkernels.nn.convert: {len(report.replaced)} module(s) replaced" and report.skipped == []
    for line, d in zip(lines[1:], report.details):  # path: old -> new [(fused activation: ...)], model order
        fused = f" (fused activation: {d.activation})" if d.activation else ""
        assert line == f"  {d.path}: {d.old} -> {d.new}{fused}" and d.new.startswith("ampkernels.nn.")
    order = [p for p, _ in model.named_modules()]
    assert [order.index(d.path) for d in report.details] == sorted(order.index(d.path) for d in report.details)
    assert {id(p) for p in model.parameters()} == params_before
    assert model.state_dict().keys() == ref.state_dict().keys()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_rel_close(_logits(model, ids), _logits(ref, ids), torch.float32, factor=10)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_converted_trains_as_the_original(name):
    """Five AdamW steps, fp32 on the CPU (the ops' torch path), from the same weights and data:
    the converted model's losses follow the original's."""
    ref = _build(name).train()
    model = copy.deepcopy(ref)
    aknn.convert(model)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))
    curves = []
    for m in (ref, model):
        torch.manual_seed(1)  # the same dropout draws, where a config keeps any
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        curve = []
        for _ in range(5):
            loss = _loss(m, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(loss.item())
        curves.append(torch.tensor(curve))
    assert curves[1][-1] < curves[1][0], curves  # it learns
    torch.testing.assert_close(curves[1], curves[0], rtol=1e-4, atol=1e-5)


def test_post_norm_output_sublayers_take_the_add_into_the_norm():
    # BERT's and RoBERTa's output sublayers (LayerNorm(dropout(dense(h)) + input)), dropout on
    from transformers.models.bert.modeling_bert import BertSelfOutput
    cfg = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0, max_position_embeddings=32)
    for cls, config in ((T.BertForMaskedLM, T.BertConfig(**cfg)), (T.RobertaForMaskedLM, T.RobertaConfig(**cfg))):
        torch.manual_seed(0)
        ref = cls(config).train()
        model = copy.deepcopy(ref)
        _, report = aknn.convert(model)
        fused = [p for p, _, new in report.replaced if new == "FusedPostNormResidual"]
        assert len(fused) == 4 and all(p.endswith(".output") for p in fused), str(report)
        assert model.state_dict().keys() == ref.state_dict().keys()
        ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(5))
        grads = []
        for m in (ref, model):
            torch.manual_seed(1)  # the same dropout masks
            m.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            grads.append((loss.detach(), [p.grad for p in m.parameters()]))
        torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(grads[1][1], grads[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    class ScaledOutput(BertSelfOutput):  # the same children, another forward: the probe tells
        def forward(self, hidden_states, input_tensor):
            return self.LayerNorm(self.dropout(self.dense(hidden_states)) + 0.5 * input_tensor)
    ScaledOutput.__module__ = BertSelfOutput.__module__
    odd = torch.nn.Sequential(ScaledOutput(T.BertConfig(**cfg)))
    _, report = aknn.convert(odd)
    assert type(odd[0]) is ScaledOutput and [p for p, _, _ in report.replaced] == ["0.LayerNorm"]
    assert [(k.path, k.reason.split(" (")[0]) for k in report.skipped] == [
        ("0", "probe: forward differs from the base operation")], str(report)


def test_mlp_found_by_structure_is_probed():
    # HF ViT's MLP module, whichever shape this transformers gives it (ViTMLP: fc1 -> activation_fn
    # -> fc2; older: ViTIntermediate: dense -> intermediate_act_fn)
    cfg = T.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32, image_size=16,
                      patch_size=8)
    mlp, proj, act = next((m, p, a) for m in T.ViTModel(cfg).modules() for p, a in (("fc1", "activation_fn"),
                                                                                    ("dense", "intermediate_act_fn"))
                          if p in m._modules and a in m._modules)

    class Scaled(type(mlp)):  # the activation's input is not the projection's output: fusing would change it
        def forward(self, x):
            return getattr(self, act)(0.5 * getattr(self, proj)(x))
    Scaled.__module__ = type(mlp).__module__
    mlp = Scaled(cfg)
    _, report = aknn.convert(torch.nn.Sequential(mlp))
    assert report.replaced == [] and type(getattr(mlp, proj)) is torch.nn.Linear
    assert report.skipped[0].path == "0" and report.skipped[0].reason.startswith("probe: forward differs"), \
        str(report)

    class Unknown(torch.nn.Module):  # fc1 + activation_fn outside transformers: not recognised
        def __init__(self):
            super().__init__()
            self.fc1, self.activation_fn, self.fc2 = torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)

        def forward(self, x):
            return self.fc2(self.activation_fn(self.fc1(x)))
    _, report = aknn.convert(torch.nn.Sequential(Unknown()))
    assert report.replaced == [] and report.skipped == []
    # a layer that holds fc1 / activation_fn beside its attention (BART's) is no MLP: not probed, untouched
    bart = T.BartForConditionalGeneration(T.BartConfig(vocab_size=V, d_model=16, encoder_layers=1, decoder_layers=1,
                                                       encoder_attention_heads=4, decoder_attention_heads=4,
                                                       encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    _, report = aknn.convert(bart, norms=False)
    assert report.replaced == [] and report.skipped == [], str(report)


def test_gemma_norm_keeps_the_raw_weight_and_gemmas_dtypes():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    g = GemmaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        g.weight.normal_(0.0, 0.3)
    holder = torch.nn.Sequential(copy.deepcopy(g))
    _, report = aknn.convert(holder)
    new = holder[0]
    assert type(new) is aknn.OffsetRMSNorm and new.offset == 1.0 and new.eps == 1e-5, str(report)
    assert new.weight is holder.state_dict(keep_vars=True)["0.weight"]
    assert torch.equal(new.weight, g.weight)  # stored raw: checkpoints load unchanged
    x = torch.randn(3, 7, 48)
    for wdtype, xdtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                           (torch.float32, torch.bfloat16), (torch.float16, torch.float16)):
        a, b = copy.deepcopy(g).to(wdtype), copy.deepcopy(new).to(wdtype)
        want, got = a(x.to(xdtype)), b(x.to(xdtype))
        assert got.dtype == want.dtype == xdtype  # Gemma: fp32 inside, cast to x's dtype at the end
        exact = x.to(xdtype).double()
        exact = exact * torch.rsqrt(exact.square().mean(-1, keepdim=True) + 1e-5) * (1 + a.weight.double())
        assert_rel_close(got, exact, xdtype)
    # gradients reach the raw weight through the +1
    w = new.weight
    new(x).square().sum().backward()
    g(x).square().sum().backward()
    assert_rel_close(w.grad, g.weight.grad, torch.float32, factor=10)


def test_norms_whose_forward_differs_are_left_alone_with_the_reason():
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    class CentredT5LayerNorm(T5LayerNorm):  # same class-name suffix and attributes, subtracts the mean
        def forward(self, x):
            return super().forward(x - x.mean(-1, keepdim=True))
    CentredT5LayerNorm.__module__ = T5LayerNorm.__module__
    CentredT5LayerNorm.__name__ = "CentredT5LayerNorm"

    class ScaledRMSNorm(torch.nn.Module):  # an `eps` RMSNorm that is neither plain nor Gemma's
        def __init__(self):
            super().__init__()
            self.eps, self.weight = 1e-6, torch.nn.Parameter(torch.ones(16))

        def forward(self, x):
            return 2 * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight
    ScaledRMSNorm.__module__ = T5LayerNorm.__module__
    model = torch.nn.Sequential(CentredT5LayerNorm(16), ScaledRMSNorm())
    _, report = aknn.convert(model)
    assert report.replaced == []
    assert [k.path for k in report.skipped] == ["0", "1"]
    assert report.skipped[0].reason.startswith("probe: forward differs")
    assert report.skipped[1].reason.startswith("as RMSNorm: probe: forward differs")
    assert "; as RMSNorm * (1 + weight): probe: forward differs" in report.skipped[1].reason


def test_unfusable_mlps_are_reported():
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP
    from transformers.models.bloom.modeling_bloom import BloomConfig, BloomMLP
    neox = GPTNeoXMLP(T.GPTNeoXConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, hidden_act="gelu"))
    neox.act = torch.nn.Tanh()
    bloom = BloomMLP(BloomConfig(hidden_size=16))
    seq = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.GELU(), torch.nn.Linear(32, 16))
    from transformers.models.phi.modeling_phi import PhiMLP
    phi = PhiMLP(T.PhiConfig(hidden_size=16, intermediate_size=32, hidden_act="gelu_new"))
    phi.fc1.weight = torch.nn.Parameter(torch.zeros(32, 16, dtype=torch.int8), requires_grad=False)  # quantized
    model = torch.nn.ModuleDict({"neox": neox, "bloom": bloom, "seq": seq, "phi": phi})
    _, report = aknn.convert(model, norms=False)
    assert report.replaced == []
    assert [(k.path, k.reason) for k in report.skipped] == [
        ("neox", "activation act is torch.nn.modules.activation.Tanh: no fused equivalent"),
        ("bloom", "activation gelu_impl is transformers.models.bloom.modeling_bloom.BloomGelu: no fused equivalent"),
        ("seq.0", "Dropout(p=0.1) between 0 and the activation 2: not fused"),
        ("phi", "fc1's weight is not a floating-point tensor (quantized?): no fused op for it")]
    assert "neox: transformers.models.gpt_neox.modeling_gpt_neox.GPTNeoXMLP (activation act is" in str(report)


def test_mlp_subclass_whose_forward_differs_fails_the_probe():
    from transformers.models.phi.modeling_phi import PhiMLP

    class Doubled(PhiMLP):
        def forward(self, x):
            return super().forward(2 * x)
    Doubled.__name__ = "PhiMLP"  # the name alone must not be trusted
    Doubled.__module__ = PhiMLP.__module__
    mlp = Doubled(T.PhiConfig(hidden_size=16, intermediate_size=32, hidden_act="gelu_new"))
    ref = copy.deepcopy(mlp)
    _, report = aknn.convert(torch.nn.Sequential(mlp))
    x = torch.randn(4, 16)
    assert type(mlp.fc1) is aknn.Linear  # its forward calls fc1 then activation_fn: equal, fused
    with torch.no_grad():
        assert_rel_close(mlp(x), ref(x), torch.float32)

    class Gated(PhiMLP):  # multiplies the activation by something else: the swap would change it
        def forward(self, x):
            return self.fc2(self.activation_fn(self.fc1(x)) * torch.sigmoid(self.fc1(x)))
    Gated.__name__, Gated.__module__ = "PhiMLP", PhiMLP.__module__
    gated = Gated(T.PhiConfig(hidden_size=16, intermediate_size=32, hidden_act="gelu_new"))
    _, report = aknn.convert(torch.nn.Sequential(gated))
    assert report.replaced == [] and type(gated.fc1) is torch.nn.Linear
    assert report.skipped[0].reason.startswith("probe: forward differs"), str(report)


# ------------------------------------------------------------------ checkpoints

def _gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64)).eval()


def _llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64)).eval()


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_state_dict_loads_both_ways(make):
    plain, converted = make(), make()
    aknn.convert(converted)
    with torch.no_grad():
        for p in converted.parameters():
            p.normal_(0.0, 0.05)
    plain.load_state_dict(converted.state_dict())  # strict: the same keys
    ids = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        assert_rel_close(converted(ids).logits, plain(ids).logits, torch.float32, factor=10)
        for p in plain.parameters():
            p.normal_(0.0, 0.05)
    converted.load_state_dict(plain.state_dict())
    with torch.no_grad():
        assert_rel_close(converted(ids).logits, plain(ids).logits, torch.float32, factor=10)


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_save_pretrained_round_trip(make, tmp_path):
    converted = make()
    aknn.convert(converted)
    with torch.no_grad():
        for p in converted.parameters():
            p.add_(0.01 * torch.randn_like(p))
    converted.save_pretrained(tmp_path / "c")
    loaded = type(converted).from_pretrained(tmp_path / "c").eval()  # an unconverted model
    assert not any(type(m).__module__.startswith("ampkernels") for m in loaded.modules())
    ids = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        assert_rel_close(loaded(ids).logits, converted(ids).logits, torch.float32, factor=10)
    aknn.convert(loaded)
    loaded.save_pretrained(tmp_path / "c2")  # and the converted one saves what the plain one loads back
    again = type(converted).from_pretrained(tmp_path / "c2").eval()
    with torch.no_grad():
        assert_rel_close(again(ids).logits, loaded(ids).logits, torch.float32, factor=10)
    assert converted.state_dict().keys() == again.state_dict().keys()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("wdtype,xdtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                           (torch.bfloat16, torch.bfloat16)])
def test_gpu_gemma_norm_kernels(backend, wdtype, xdtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    g = GemmaRMSNorm(1000, eps=1e-6).cuda()  # an odd width
    with torch.no_grad():
        g.weight.normal_(0.0, 0.3)
    holder = torch.nn.Sequential(copy.deepcopy(g))
    aknn.convert(holder, backend=backend)
    new = holder[0].to(wdtype)
    assert type(new) is aknn.OffsetRMSNorm
    x = (torch.randn(37, 1000, device="cuda") * 3 + 0.5).to(xdtype).requires_grad_()
    dy = torch.randn(37, 1000, device="cuda").to(xdtype)
    out = new(x)
    out.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), new.weight.detach().double().requires_grad_()
    ref = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * (1 + w64)
    ref.backward(dy.double())
    assert out.dtype == xdtype
    assert_rel_close(out, ref, xdtype, what="out")
    assert_rel_close(x.grad, x64.grad, xdtype, factor=2, what="dx")
    assert_rel_close(new.weight.grad, w64.grad, wdtype if wdtype != torch.float32 else xdtype, factor=2, what="dw")
