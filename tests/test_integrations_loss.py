"""ampkernels.integrations.loss on tiny Hugging Face causal LMs and BERT masked LMs (CPU): the
same loss and gradients as the unpatched model, no logits, state_dict / save_pretrained
untouched, eval and generation unchanged, models it cannot handle refused."""
import copy

import pytest
import torch
from torch.nn import CrossEntropyLoss

transformers = pytest.importorskip("transformers")

from ampkernels.integrations.loss import (fuse_causal_lm_loss, fuse_lm_loss, fuse_masked_lm_loss, is_fused,  # noqa: E402
                                         unfuse_causal_lm_loss)


def _gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=64, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=103, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _pair(name):
    torch.manual_seed(0)
    ref = MODELS[name]()
    model = copy.deepcopy(ref)
    ref.train()
    model.train()
    return fuse_causal_lm_loss(model), ref


def _batch(model, b=2, t=11):
    ids = torch.randint(0, model.config.vocab_size, (b, t))
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt left out of the loss
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    labels[1, -2:] = -100
    return ids, mask, labels


def _assert_same_grads(model, ref):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", list(MODELS))
def test_same_loss_and_gradients_no_logits(name):
    model, ref = _pair(name)
    ids, mask, labels = _batch(model)
    out = model(ids, attention_mask=mask, labels=labels)
    want = ref(ids, attention_mask=mask, labels=labels)
    assert type(out) is type(want) and out.logits is None and want.logits is not None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    want.loss.backward()
    _assert_same_grads(model, ref)


@pytest.mark.parametrize("name", list(MODELS))
def test_trainer_kwargs_and_tuple_output(name):
    # num_items_in_batch (gradient accumulation: sum / count) and return_dict=False
    model, ref = _pair(name)
    ids, mask, labels = _batch(model)
    n = torch.tensor(13)
    out = model(input_ids=ids, labels=labels, num_items_in_batch=n, return_dict=False)
    want = ref(input_ids=ids, labels=labels, num_items_in_batch=n, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], want[0], rtol=1e-5, atol=1e-6)
    out[0].backward()
    want[0].backward()
    _assert_same_grads(model, ref)


@pytest.mark.parametrize("name", list(MODELS))
def test_state_dict_save_pretrained_eval_and_generate_untouched(name, tmp_path):
    model, ref = _pair(name)
    assert is_fused(model) and set(model.state_dict()) == set(ref.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
    model.save_pretrained(tmp_path / "m")
    loaded = type(ref).from_pretrained(tmp_path / "m")
    assert not is_fused(loaded)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
    ids, mask, labels = _batch(model)
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, want = model(ids, labels=labels), ref(ids, labels=labels)  # eval: the original forward, logits kept
    torch.testing.assert_close(out.logits, want.logits)
    torch.testing.assert_close(out.loss, want.loss)
    gen = model.generate(ids[:1, :3], max_new_tokens=3, do_sample=False)
    assert torch.equal(gen, ref.generate(ids[:1, :3], max_new_tokens=3, do_sample=False))
    model.train()
    assert model(ids).logits is not None  # no labels: logits as usual
    unfuse_causal_lm_loss(model)
    assert not is_fused(model) and model(ids, labels=labels).logits is not None


def test_tied_gpt2_head_gets_one_gradient():
    model, ref = _pair("gpt2")
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, _, labels = _batch(model)
    model(ids, labels=labels).loss.backward()
    ref(ids, labels=labels).loss.backward()
    torch.testing.assert_close(model.transformer.wte.weight.grad, ref.transformer.wte.weight.grad, rtol=1e-4,
                               atol=1e-6)


def test_refuses_final_logit_softcapping():
    cfg = transformers.Gemma2Config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, vocab_size=97)
    model = transformers.Gemma2ForCausalLM(cfg)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        fuse_causal_lm_loss(model)
    assert not is_fused(model) and "forward" not in vars(model)


def test_refuses_forward_that_touches_logits():
    class Scaled(transformers.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            outputs = self.model(input_ids=input_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            logits = self.lm_head(hidden_states)
            logits = logits * 2
            loss = self.loss_function(logits, labels, self.config.vocab_size)
            return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    model = Scaled(_llama().config)
    with pytest.raises(ValueError, match="changes the logits before the loss"):
        fuse_causal_lm_loss(model)


def test_refuses_non_linear_head_and_hooks():
    model = _llama()
    model.lm_head.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="forward hooks"):
        fuse_causal_lm_loss(model)
    with pytest.raises(ValueError, match="not a transformers PreTrainedModel"):
        fuse_causal_lm_loss(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_autocast_training_matches(name, backend):
    # fp32 master weights under bf16 autocast: the loss and gradients of the unpatched model
    model, ref = _pair(name)
    model.cuda()
    ref.cuda()
    fuse_causal_lm_loss(model, backend=backend)
    ids, mask, labels = (a.cuda() for a in _batch(model, b=3, t=40))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(ids, attention_mask=mask, labels=labels)
        want = ref(ids, attention_mask=mask, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, want.loss, rtol=2e-3, atol=2e-3)
    out.loss.backward()
    want.loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is not None:
            err = ((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
            assert err < 2e-2, (n, err)


# ---------------------------------------------------------------- masked LMs (BERT's head)

def _bert(vocab=211):
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=vocab, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    ref = transformers.BertForMaskedLM(cfg).train()
    return fuse_masked_lm_loss(copy.deepcopy(ref)), ref


def _mlm_batch(model, b=3, t=13, rate=0.3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (b, t), generator=g)
    labels = torch.where(torch.rand(b, t, generator=g) < rate, ids, -100)
    return ids, labels


def test_masked_lm_same_loss_and_gradients_no_logits():
    model, ref = _bert()
    ids, labels = _mlm_batch(model)
    mask = torch.ones_like(ids)
    mask[2, -3:] = 0
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    want = ref(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is None and type(out) is type(want)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    out.loss.backward()
    want.loss.backward()
    # the key biases' gradients are zero up to rounding (softmax ignores a per-query constant)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None and not n.endswith("key.bias"):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_masked_lm_runs_the_head_on_the_labelled_rows_alone():
    model, ref = _bert()
    ids, labels = _mlm_batch(model)
    seen = []
    model.cls.predictions.transform.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss,
                               rtol=1e-5, atol=1e-6)
    assert seen == [int((labels != -100).sum())]


def test_labelled_rows_op():
    from ampkernels.integrations.loss import labelled_rows
    t = torch.tensor([3, -100, 5, -100, 7, 0])
    assert labelled_rows(t, -100).tolist() == [0, 2, 4, 5] and labelled_rows(t, 0).tolist() == [0, 1, 2, 3, 4]
    assert labelled_rows(torch.full((4,), -100), -100).numel() == 0
    torch.library.opcheck(torch.ops.ampkernels.labelled_rows.default, (t, -100))  # dynamic shapes among its checks


def test_masked_lm_while_capturing_a_cuda_graph_runs_every_row(monkeypatch):
    # the row search would sync, which a capture forbids: every row, the unlabelled ones ignored
    import ampkernels.integrations.loss as loss_mod
    model, ref = _bert()
    ids, labels = _mlm_batch(model)
    seen = []
    model.cls.predictions.transform.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[0]))
    monkeypatch.setattr(loss_mod, "_capturing", lambda t: True)
    got = model(input_ids=ids, labels=labels).loss
    assert seen == [ids.numel()]
    torch.testing.assert_close(got, ref(input_ids=ids, labels=labels).loss, rtol=1e-5, atol=1e-6)


def test_masked_lm_under_compile_one_graph_for_any_count_of_labelled_rows():
    # inductor, fullgraph: the labelled rows are found in the graph (a length known at run time),
    # so no graph break and no recompile when the count changes; loss and gradients as eager's
    model, ref = _bert()
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for rate in (0.3, 0.6):
        ids, labels = _mlm_batch(model, rate=rate)
        got, want = compiled(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        got.backward()
        want.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if q.grad is not None and not n.endswith("key.bias"):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)
        model.zero_grad()
        ref.zero_grad()
    assert len(graphs) == 1 and "labelled_rows" in graphs[0]
    if hasattr(torch.Tag, "cudagraph_unsafe"):  # it syncs: inductor keeps it out of CUDA graphs
        assert torch.Tag.cudagraph_unsafe in torch.ops.ampkernels.labelled_rows.default.tags
    torch._dynamo.reset()


def test_converted_masked_lm_under_compile_with_dynamic_shapes():
    # as the e2e benchmark converts BERT: the head's converted Linear + GELU and LayerNorm see a
    # row count known only at run time, which their size decisions must not guard on (fullgraph)
    from ampkernels.integrations import transformers as ak_hf
    model, ref = _bert()
    unfuse_causal_lm_loss(model)
    ak_hf.apply(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for t in (13, 17):
        ids, labels = _mlm_batch(model, t=t)
        torch.testing.assert_close(compiled(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss,
                                   rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_masked_lm_finds_its_rows_before_the_base_model_runs():
    # the row search syncs with the GPU: made before the encoder's work is queued, it waits for none of it
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    model, _ = _bert()
    ids, labels = _mlm_batch(model)
    with Calls() as calls:
        model(input_ids=ids, labels=labels)
    assert "labelled_rows.default" in calls.names and "embedding" in calls.names
    assert calls.names.index("labelled_rows.default") < calls.names.index("embedding")


def test_masked_lm_edges_eval_and_unfuse():
    model, ref = _bert()
    ids, labels = _mlm_batch(model)
    none = torch.full_like(ids, -100)
    assert model(input_ids=ids, labels=none).loss.isnan() and ref(input_ids=ids, labels=none).loss.isnan()
    model.eval()
    ref.eval()
    torch.testing.assert_close(model(input_ids=ids, labels=labels).logits, ref(input_ids=ids, labels=labels).logits)
    assert is_fused(model) and set(model.state_dict()) == set(ref.state_dict())
    unfuse_causal_lm_loss(model)
    model.train()
    assert not is_fused(model) and model(input_ids=ids, labels=labels).logits is not None


def test_masked_lm_other_structures_refused():
    model, _ = _bert()
    unfuse_causal_lm_loss(model)
    model.cls.predictions.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="fuse_masked_lm_loss: cannot fuse BertForMaskedLM: BertLMPredictionHead has"):
        fuse_masked_lm_loss(model)
    cfg = transformers.RobertaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=97, max_position_embeddings=64)
    roberta = transformers.RobertaForMaskedLM(cfg)
    with pytest.raises(ValueError, match="not the decoder of a head with a transform"):
        fuse_masked_lm_loss(roberta)
    assert "forward" not in vars(roberta)
    with pytest.raises(ValueError, match="does not return a MaskedLMOutput"):
        fuse_masked_lm_loss(_gpt2())

    class Plain(transformers.BertForMaskedLM):  # BERT's forward, restated: accepted
        def forward(self, input_ids=None, labels=None, **kwargs) -> transformers.modeling_outputs.MaskedLMOutput:
            outputs = self.bert(input_ids, return_dict=True, **kwargs)
            sequence_output = outputs[0]
            prediction_scores = self.cls(sequence_output)
            loss_fct = CrossEntropyLoss()
            loss = loss_fct(prediction_scores.view(-1, self.config.vocab_size), labels.view(-1))
            return transformers.modeling_outputs.MaskedLMOutput(loss=loss, logits=prediction_scores)

    class Scaled(transformers.BertForMaskedLM):  # the same, with the scores changed before the loss
        def forward(self, input_ids=None, labels=None, **kwargs) -> transformers.modeling_outputs.MaskedLMOutput:
            outputs = self.bert(input_ids, return_dict=True, **kwargs)
            sequence_output = outputs[0]
            prediction_scores = self.cls(sequence_output) / 2
            loss_fct = CrossEntropyLoss()
            loss = loss_fct(prediction_scores.view(-1, self.config.vocab_size), labels.view(-1))
            return transformers.modeling_outputs.MaskedLMOutput(loss=loss, logits=prediction_scores)

    cfg = _bert()[1].config
    assert is_fused(fuse_masked_lm_loss(Plain(cfg)))
    with pytest.raises(ValueError, match="its forward is not 'self.bert"):
        fuse_masked_lm_loss(Scaled(cfg))
    # fuse_lm_loss picks the kind from the forward's output class
    assert is_fused(fuse_lm_loss(_bert()[1])) and is_fused(fuse_lm_loss(_gpt2()))


@pytest.mark.gpu
@pytest.mark.parametrize("backend, compiled", [("cuda", False), ("triton", False), ("cuda", True), (None, True)])
def test_gpu_masked_lm_autocast_training_matches(backend, compiled):
    # compiled: the labelled rows' count is known only at run time, in the graph and in the op;
    # converted as the e2e benchmark converts BERT (the head's Linear + GELU and LayerNorm too)
    model, ref = _bert(vocab=1003)
    model.cuda()
    ref.cuda()
    if compiled:
        from ampkernels.integrations import transformers as ak_hf
        unfuse_causal_lm_loss(model)
        ak_hf.apply(model, backend=backend)
    fuse_masked_lm_loss(model, backend=backend)
    ids, labels = (a.cuda() for a in _mlm_batch(model, b=4, t=48, rate=0.15))
    torch._dynamo.reset()
    fwd = torch.compile(model, fullgraph=True) if compiled else model
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = fwd(input_ids=ids, labels=labels)
        want = ref(input_ids=ids, labels=labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, want.loss, rtol=2e-3, atol=2e-3)
    out.loss.backward()
    want.loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is not None and not n.endswith("key.bias"):
            err = ((p.grad - q.grad).norm() / q.grad.norm().clamp_min(1e-30)).item()
            assert err < 2e-2, (n, err)


@pytest.mark.gpu
def test_gpu_masked_lm_loss_in_a_cuda_graph():
    # captured, the head runs on every row (the row search would sync); replayed, the same loss
    model, ref = _bert(vocab=1003)
    model.cuda()
    ref.cuda()
    ids, labels = (a.cuda() for a in _mlm_batch(model, b=4, t=48, rate=0.15))
    with torch.no_grad():
        want = ref(input_ids=ids, labels=labels).loss
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                model(input_ids=ids, labels=labels)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = model(input_ids=ids, labels=labels).loss
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
