"""One-line integrations: ampkernels.integrations.transformers (apply, ConvertCallback inside a
Trainer on CPU) and ampkernels.integrations.timm."""
import copy

import pytest
import torch

import ampkernels.nn as aknn
from tests.utils import assert_rel_close

V = 64


def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def test_transformers_apply_converts_in_place_and_looks_through_wrappers():
    from ampkernels.integrations import transformers as ak_hf
    ref = _gpt2().eval()
    model = copy.deepcopy(ref)
    report = ak_hf.apply(model)
    assert isinstance(report, aknn.ConvertReport)
    assert sorted({new for _, _, new in report.replaced}) == ["Conv1DAct", "LayerNorm"]
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        assert_rel_close(model(ids).logits, ref(ids).logits, torch.float32, factor=10)
    wrapped = torch.nn.DataParallel(copy.deepcopy(ref))  # on CPU DataParallel runs the module itself
    report = ak_hf.apply(wrapped, backend="torch", linears=False)
    assert {new for _, _, new in report.replaced} == {"LayerNorm"}
    assert all(m.backend == "torch" for m in wrapped.module.modules() if isinstance(m, aknn.LayerNorm))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ak_hf.apply({"not": "a model"})


def _trainer_losses(tmp_path, callbacks=(), convert_first=False):
    import transformers
    from ampkernels.integrations import transformers as ak_hf
    model = _gpt2()
    if convert_first:
        ak_hf.apply(model)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, V, (8, 16), generator=gen)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                          learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
                                          use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2
    return losses, trainer.model


def test_trainer_runs_two_steps_converted_with_the_same_losses(tmp_path):
    pytest.importorskip("accelerate")
    from ampkernels.integrations import transformers as ak_hf
    plain, _ = _trainer_losses(tmp_path / "plain")
    applied, model = _trainer_losses(tmp_path / "apply", convert_first=True)
    assert any(type(m).__name__ == "Conv1DAct" for m in model.modules())
    callback = ak_hf.ConvertCallback()
    called, model = _trainer_losses(tmp_path / "callback", callbacks=[callback])
    assert callback.report is not None and len(callback.report.replaced) == 7, str(callback.report)
    assert any(type(m) is aknn.LayerNorm for m in model.modules())
    for losses in (applied, called):
        assert losses == pytest.approx(plain, rel=1e-4)


def test_timm_apply():
    timm = pytest.importorskip("timm")
    from ampkernels.integrations import timm as ak_timm
    torch.manual_seed(0)
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=1, img_size=32, patch_size=8,
                            num_classes=10).eval()
    model = copy.deepcopy(ref)
    report = ak_timm.apply(model)
    assert {new for _, _, new in report.replaced} == {"LayerNorm", "Linear", "FusedResidualBlocks"}
    assert report.skipped == []
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_rel_close(model(x), ref(x), torch.float32)


def test_apply_after_accelerate_prepare_trains_the_prepared_parameters():
    accelerate = pytest.importorskip("accelerate")
    from ampkernels.integrations import transformers as ak_hf
    model = _gpt2().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = accelerate.Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, opt)
    report = ak_hf.apply(model)  # after prepare: the optimizer's Parameters are the converted modules'
    fused = accelerator.unwrap_model(model).transformer.h[0].mlp.c_fc
    assert type(fused).__name__ == "Conv1DAct" and len(report.replaced) == 7
    before = fused.weight.detach().clone()
    ids = torch.randint(0, V, (2, 12))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    assert not torch.equal(fused.weight, before)


def test_transformers_apply_fuses_the_lm_loss_and_reports_what_it_cannot():
    transformers = pytest.importorskip("transformers")
    import inspect
    from ampkernels.integrations import loss as ak_loss, transformers as ak_hf
    ref = _gpt2().train()
    model = copy.deepcopy(ref)
    report = ak_hf.apply(model)
    assert report.fused_loss and ak_loss.is_fused(model) and "LM head + loss fused" in str(report)
    # the wrapper keeps the forward's signature (Trainer selects dataset columns by it)
    assert list(inspect.signature(model.forward).parameters) == list(inspect.signature(ref.forward).parameters)
    ids = torch.randint(0, V, (2, 12))
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    assert_rel_close(out.loss, ref(input_ids=ids, labels=ids).loss, torch.float32, factor=10)
    unfused = copy.deepcopy(ref)
    assert not ak_hf.apply(unfused, fuse_loss=False).fused_loss and not ak_loss.is_fused(unfused)
    cfg = dict(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=32)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(**cfg))
    assert ak_hf.apply(bert).fused_loss and ak_loss.is_fused(bert)  # BERT's masked-LM head
    roberta = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**cfg))  # its head has no transform
    report = ak_hf.apply(roberta)
    assert not report.fused_loss and not ak_loss.is_fused(roberta)
    assert any(k.path == "" and "LM head + loss not fused" in k.reason for k in report.skipped), str(report)
