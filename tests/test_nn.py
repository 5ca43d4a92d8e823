"""Drop-in modules and convert(): the torch modules they replace, and real model structures."""
import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import ampkernels
import ampkernels.nn as aknn
from ampkernels.ops import gated_linear_act as gla, layer_norm as ln_ops, mlp as mlp_ops
from tests.utils import assert_rel_close

transformers = pytest.importorskip("transformers")


def _same_grads(a, b, dtype, factor=4):
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert_rel_close(pa.grad, pb.grad, dtype, factor=factor, what=f"grad of {name}")


# ------------------------------------------------------------------ modules vs torch

def _module_pairs(device, dtype=None):
    kw = dict(device=device, dtype=dtype)
    return [
        (torch.nn.LayerNorm(96, **kw), aknn.LayerNorm(96, **kw)),
        (torch.nn.LayerNorm((4, 24), eps=1e-6, bias=False, **kw), aknn.LayerNorm((4, 24), eps=1e-6, bias=False, **kw)),
        (torch.nn.RMSNorm(96, **kw), aknn.RMSNorm(96, **kw)),
        (torch.nn.Sequential(torch.nn.Linear(96, 40, **kw), torch.nn.GELU(approximate="tanh")),
         aknn.Linear(96, 40, activation="gelu_tanh", **kw)),
        (torch.nn.Sequential(torch.nn.Linear(96, 200, **kw), torch.nn.SiLU(), torch.nn.Linear(200, 96, **kw)),
         aknn.FusedMLP(96, 200, activation="silu", **kw)),
    ]


def _load_shared(torch_mod, ak_mod):
    sd = torch_mod.state_dict()
    if isinstance(ak_mod, aknn.Linear):
        sd = {k.split(".", 1)[1]: v for k, v in sd.items()}  # Sequential(Linear, act) -> Linear keys
    ak_mod.load_state_dict(sd)


@pytest.mark.parametrize("index", range(5))
def test_modules_match_torch_on_cpu(index):
    torch_mod, ak_mod = _module_pairs("cpu")[index]
    with torch.no_grad():
        for p in torch_mod.parameters():
            p.normal_(0, 0.3)  # non-trivial weights, not ones/zeros
    _load_shared(torch_mod, ak_mod)
    x = torch.randn(3, 5, 4, 24) if index == 1 else torch.randn(3, 5, 96)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_t, out_a = torch_mod(xa), ak_mod(xb)
    assert_rel_close(out_a, out_t, torch.float32, factor=10)
    dy = torch.randn_like(out_t)
    out_t.backward(dy)
    out_a.backward(dy)
    assert_rel_close(xb.grad, xa.grad, torch.float32, factor=10)
    _same_grads(torch_mod, ak_mod, torch.float32, factor=10)


def test_state_dict_and_repr_are_torchs():
    t, a = torch.nn.LayerNorm(64), aknn.LayerNorm(64)
    assert repr(t) == repr(a) and t.state_dict().keys() == a.state_dict().keys()
    t, a = torch.nn.RMSNorm(64, eps=1e-6), aknn.RMSNorm(64, eps=1e-6)
    assert repr(t) == repr(a) and t.state_dict().keys() == a.state_dict().keys()
    seq = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    mlp = aknn.FusedMLP(8, 32, activation="gelu")
    mlp.load_state_dict(seq.state_dict())  # both ways, same keys
    seq.load_state_dict(mlp.state_dict())
    assert torch.equal(seq[2].weight, mlp[2].weight)
    lin = aknn.Linear(8, 4, activation="relu")
    torch.nn.Linear(8, 4).load_state_dict(lin.state_dict())
    assert "activation='relu'" in repr(lin) and isinstance(lin, torch.nn.Linear)


def test_norm_out_dtype_option():
    x = torch.randn(4, 64)
    ln = aknn.LayerNorm(64, out_dtype="autocast")
    assert ln(x).dtype == torch.float32  # autocast off: input dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ln(x).dtype == torch.bfloat16
        assert_rel_close(ln(x), torch.nn.functional.layer_norm(x.double(), (64,)), torch.bfloat16)
    assert aknn.RMSNorm(64, out_dtype=torch.float16)(x).dtype == torch.float16
    with pytest.raises(ValueError, match="out_dtype must be"):
        aknn.LayerNorm(64, out_dtype="half")(x)


def test_module_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation must be one of"):
        aknn.Linear(4, 4, activation="tanh")


# ------------------------------------------------------------------ convert()

def _tiny_models():
    T = transformers
    bert = T.BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    gpt2 = T.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    llama = T.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return {"bert": (T.BertForMaskedLM, bert), "gpt2": (T.GPT2LMHeadModel, gpt2), "llama": (T.LlamaForCausalLM, llama)}


EXPECTED = {  # what convert() must find in the 2-layer configs above
    # embeddings + 2 per layer + MLM head; 2 intermediates + head; the 2 output sublayers per layer
    "bert": {"LayerNorm": 6, "Linear": 3, "FusedPostNormResidual": 4},
    "gpt2": {"LayerNorm": 5, "Conv1DAct": 2},  # ln_1, ln_2 per layer + ln_f; c_fc per layer
    "llama": {"RMSNorm": 5, "FusedGatedMLP": 2},  # 2 per layer + final norm; the gated MLP per layer
}


def _build(name, device="cpu"):
    cls, cfg = _tiny_models()[name]
    torch.manual_seed(0)
    return cls(cfg).to(device).eval()


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_convert_hf_models_on_cpu(name):
    ref = _build(name)
    model = copy.deepcopy(ref)
    params_before = {id(p) for p in model.parameters()}
    _, report = aknn.convert(model)
    counts = {}
    for _, _, new in report.replaced:
        counts[new] = counts.get(new, 0) + 1
    assert counts == EXPECTED[name], str(report)
    assert {id(p) for p in model.parameters()} == params_before  # shared, never copied
    assert model.state_dict().keys() == ref.state_dict().keys()
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        assert_rel_close(model(ids).logits, ref(ids).logits, torch.float32, factor=10)


def test_convert_options_and_unknown_models():
    seq = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.LayerNorm(16), torch.nn.Tanh())
    only_norms = copy.deepcopy(seq)
    _, report = aknn.convert(only_norms, linears=False)
    assert [r[2] for r in report.replaced] == ["LayerNorm"] and type(only_norms[0]) is torch.nn.Linear
    _, report = aknn.convert(seq, norms=False, backend="torch")
    assert [r[2] for r in report.replaced] == ["Linear"] and seq[0].activation == "relu"
    assert isinstance(seq[1], torch.nn.Identity) and seq[0].backend == "torch"

    class Custom(torch.nn.Module):  # activation applied through something we cannot see
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.act = torch.nn.Tanh()

        def forward(self, x):
            return self.act(self.fc(x)) * 2

    custom = Custom()
    before = copy.deepcopy(custom.state_dict())
    _, report = aknn.convert(custom)
    assert report.replaced == [] and "unchanged" in str(report)
    assert type(custom.fc) is torch.nn.Linear and all(torch.equal(before[k], v) for k, v in custom.state_dict().items())
    with pytest.raises(ValueError, match="backend must be one of"):
        aknn.convert(custom, backend="fast")


# ------------------------------------------------------------------ GPU tier

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index", range(5))
def test_modules_match_torch_under_autocast(dtype, index):
    torch_mod, ak_mod = _module_pairs("cuda")[index]
    with torch.no_grad():
        for p in torch_mod.parameters():
            p.normal_(0, 0.3)
    _load_shared(torch_mod, ak_mod)
    x = torch.randn(4, 33, 4, 24) if index == 1 else torch.randn(4, 33, 96)
    x = x.to("cuda", dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=dtype):
        out_t, out_a = torch_mod(xa), ak_mod(xb)
    assert out_a.dtype == dtype  # norms keep the activation dtype (nn.LayerNorm gives fp32 here)
    assert_rel_close(out_a.float(), out_t.float(), dtype, factor=4)
    dy = torch.randn_like(out_t)
    out_t.backward(dy)
    out_a.backward(dy.to(out_a.dtype))
    assert_rel_close(xb.grad, xa.grad, dtype, factor=4)
    _same_grads(torch_mod, ak_mod, dtype, factor=8)


@pytest.mark.gpu
def test_fused_mlp_keeps_one_hidden_tensor():
    def saved_bytes(mod, x):
        sizes = []
        def pack(t):
            sizes.append(t.numel() * t.element_size() if t.numel() > 96 * 96 * 4 else 0)
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cuda", dtype=torch.float16):
                mod(x)
        return sum(sizes)
    x = torch.randn(4096, 96, device="cuda", requires_grad=True)
    seq = torch.nn.Sequential(torch.nn.Linear(96, 384), torch.nn.GELU(), torch.nn.Linear(384, 96)).cuda()
    mlp = aknn.FusedMLP(96, 384, activation="gelu").cuda()
    hidden = 4096 * 384 * 2
    assert saved_bytes(seq, x) >= 2 * hidden
    assert saved_bytes(mlp, x) < 2 * hidden


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_convert_hf_models_train_the_same(name, dtype):
    ref = _build(name, "cuda").train()
    model = copy.deepcopy(ref)
    aknn.convert(model)
    ids = torch.randint(0, 100, (4, 32), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        assert_rel_close(model(ids).logits.float(), ref(ids).logits.float(), dtype, factor=4)
    losses = {}
    for tag, m in (("ref", ref), ("ak", model)):
        torch.manual_seed(1)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        curve = []
        for _ in range(20):
            with torch.autocast("cuda", dtype=dtype):
                out = m(ids, labels=ids)
            scaler.scale(out.loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            curve.append(out.loss.item())
        losses[tag] = torch.tensor(curve)
    assert losses["ak"][-1] < losses["ak"][0]  # it learns
    assert (losses["ak"] - losses["ref"]).abs().max() < 0.05 * losses["ref"].abs().max(), losses


@pytest.mark.gpu
def test_modules_compile_fullgraph_and_checkpoint():
    mlp = torch.nn.Sequential(aknn.LayerNorm(128), aknn.FusedMLP(128, 512)).cuda()
    x = torch.randn(256, 128, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = mlp(x)
        compiled = torch.compile(mlp, fullgraph=True)(x)
        ckpt = torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False)
    assert_rel_close(compiled.float(), eager.float(), torch.bfloat16)
    assert_rel_close(ckpt.float(), eager.float(), torch.bfloat16)
    ckpt.float().sum().backward()
    assert torch.isfinite(x.grad).all()


# ------------------------------------------------------------------ under torch.compile

def _compiled_ops(fn, *args):
    """(result of fn compiled fullgraph, the op targets of the forward and backward graphs that
    AOTAutograd hands a compiler, which here runs them as they are)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    targets = []

    def keep(g, example_inputs):
        targets.extend(str(n.target) for n in g.graph.nodes if n.op == "call_function")
        return make_boxed_func(g.forward)

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep)

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)(*args), targets


def test_auto_hands_the_ops_to_inductor_under_compile():
    # the decision itself, on any machine: under torch.compile "auto" prefers torch for every op
    from ampkernels.ops import layer_norm as ln, linear_act as la

    cuda = torch.device("cuda")
    assert la.preference(cuda, torch.bfloat16, "gelu_tanh", "large", True, compiling=True) == ("torch",)
    assert mlp_ops.auto_preference(cuda, torch.bfloat16, "gelu", "large", True, compiling=True) == ("torch",)
    assert gla.preference(cuda, torch.bfloat16, "silu", "large", True, compiling=True) == ("torch",)
    x = torch.randn(4, 8, dtype=torch.float16)
    assert ln._preferences(x, torch.float32, compiling=True) == (("torch",), ("torch",))


@pytest.mark.parametrize("op", ["linear_act", "fused_mlp", "gated_linear_act"])
def test_auto_sees_compile_where_torch_does_not_say_so(monkeypatch, op):
    # Dynamo runs the ops' _choose as plain Python (a constant of the graph); there torch before
    # 2.14 answers is_compiling() with False (2.14 holds the flag through the compile session).
    # Emulated here: without the flag "auto" picked the eager order, so the kernels ran as opaque
    # custom ops in compiled graphs (12 gated custom-op pairs a step in the LLaMA-style model).
    from ampkernels import backends
    monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext, raising=False)
    seen = []
    real = backends.select
    monkeypatch.setattr(backends, "select", lambda name, backend, device, pref, *a: seen.append(pref) or
                        real(name, backend, device, pref, *a))
    x = torch.randn(16, 32, requires_grad=True)
    w1, w2 = torch.randn(64, 32, requires_grad=True), torch.randn(32, 64, requires_grad=True)
    calls = {"linear_act": lambda: ampkernels.linear_act(x, w1),
             "fused_mlp": lambda: mlp_ops.fused_mlp(x, w1, None, w2, None),
             "gated_linear_act": lambda: ampkernels.gated_linear_act(x, w1, w1)}
    torch._dynamo.reset()
    torch.compile(calls[op], backend="eager", fullgraph=True)().sum().backward()
    assert seen and all(p == ("torch",) for p in seen), seen


@pytest.mark.parametrize("device,dtype", [("cpu", torch.bfloat16),
                                          pytest.param("cuda", torch.float16, marks=pytest.mark.gpu),
                                          pytest.param("cuda", torch.bfloat16, marks=pytest.mark.gpu)])
def test_converted_block_compiles_to_inductor_kernels(device, dtype):
    # "auto" under torch.compile: no ampkernels op reaches inductor, and the step matches eager
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 1024), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(1024, 256), torch.nn.RMSNorm(256)).to(device)
    ref = copy.deepcopy(block)
    aknn.convert(block)
    x = torch.randn(512, 256, device=device)

    def step(m, x):
        with torch.autocast(device, dtype=dtype):
            return m(x).float().square().mean()

    loss, targets = _compiled_ops(lambda x: step(block, x), x)
    loss.backward()
    step(ref, x).backward()
    assert not [t for t in targets if "ampkernels" in t], targets
    assert any("layer_norm" in t for t in targets)
    _same_grads(block, ref, dtype, factor=8)


@pytest.mark.gpu
def test_explicit_backend_stays_a_custom_op_under_compile():
    ln = aknn.LayerNorm(256, backend="cuda").cuda()
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, targets = _compiled_ops(lambda x: ln(x).float().sum(), x)
    out.backward()
    assert any("ampkernels" in t for t in targets), targets


# ---------------------------------------------------------------- the norm modules' eager entry

def _entry_cases(device):
    n = 96
    for cls, kw in ((aknn.LayerNorm, {}), (aknn.LayerNorm, dict(bias=False)), (aknn.RMSNorm, {}),
                    (aknn.RMSNorm, dict(eps=1e-5)), (aknn.OffsetRMSNorm, {})):
        for xdt in (torch.float16, torch.bfloat16, torch.float32):
            for pdt in {xdt, torch.float32}:
                for out_dtype in (None, "autocast", torch.float16):
                    mod = cls(n, out_dtype=out_dtype, **kw).to(device, pdt)
                    yield mod, torch.randn(3, 7, n, device=device, dtype=xdt)


def test_module_entry_declines_what_it_does_not_run():
    # CPU tensors, subclasses and unusual arguments go to layer_norm(), which validates in full
    entry = ln_ops.module_entry()
    x, w = torch.randn(4, 8), torch.randn(8)
    assert entry(x, w, None, 1e-5, False, None, None, 1 << 25) is NotImplemented
    if ampkernels.available_backends()["cuda"][0]:
        from ampkernels import _C
        xc, wc = x.cuda(), w.cuda()
        assert entry is _C.norm_module
        assert isinstance(entry(xc, wc, None, 1e-5, False, None, None, 1 << 25), torch.Tensor)
        class Sub(torch.Tensor):
            pass
        for args in ((xc.t(), wc[:4]), (xc, wc[:4]), (xc, wc.double()), (xc.double(), wc.double()),
                     (xc.as_subclass(Sub), wc), (xc, wc.as_subclass(Sub)), (xc[:, :0], wc[:0])):
            assert entry(*args, None, 1e-5, False, None, None, 1 << 25) is NotImplemented
        for eps, out_dtype, backend in ((1, None, None), (1e-5, torch.float64, None), (1e-5, "auto", None),
                                        (1e-5, None, "triton"), (1e-5, None, "torch"), (1e-5, None, 3),
                                        (1e-5, None, "\udc80")):
            assert entry(xc, wc, None, eps, False, out_dtype, backend, 1 << 25) is NotImplemented
        assert entry(xc, wc, wc, 1e-5, True, None, None, 1 << 25) is NotImplemented  # RMSNorm has no bias
        assert entry(xc, wc, None, 1e-5, False, None, None, 8) is NotImplemented  # "auto" would pick Triton
    else:
        assert entry is ln_ops._declined


@pytest.mark.gpu
def test_module_entry_matches_the_full_path(monkeypatch):
    # the modules' plain eager call goes straight to the op: the same outputs and gradients, bit
    # for bit, as layer_norm() / rms_norm() on the same arguments, with and without autocast
    import ampkernels.nn.modules as mods
    torch.manual_seed(0)
    for autocast in (False, True):
        for mod, x in _entry_cases("cuda"):
            x.requires_grad_()
            taken = []
            entry = ln_ops.module_entry()
            monkeypatch.setattr(mods, "_norm_entry", lambda *a: taken.append(entry(*a)) or taken[-1])
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                got = mod(x)
                monkeypatch.setattr(mods, "_norm_entry", ln_ops._declined)
                want = mod(x)
            assert len(taken) == 1 and taken[0] is got  # the entry ran the call, not the full path
            assert got.dtype == want.dtype and torch.equal(got, want), (type(mod), x.dtype, mod.out_dtype)
            g = torch.randn_like(got)
            leaves = [x] + [p for p in mod.parameters()]
            for a, e in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
                assert a.dtype == e.dtype and torch.equal(a, e)
    # declined: the environment asks for another backend, or a torch-function mode is on
    mod, x = aknn.LayerNorm(64).cuda(), torch.randn(8, 64, device="cuda")
    monkeypatch.setattr(mods, "_norm_entry", ln_ops.module_entry())
    monkeypatch.setenv("AMPKERNELS_BACKEND", "torch")
    assert mods._norm_entry(x, mod.weight, mod.bias, mod.eps, False, None, None, 1 << 25) is NotImplemented
    monkeypatch.delenv("AMPKERNELS_BACKEND")
    with torch.overrides.TorchFunctionMode():
        assert mods._norm_entry(x, mod.weight, mod.bias, mod.eps, False, None, None, 1 << 25) is NotImplemented


# ---------------------------------------------------------------- the GEMM ops' eager entry

def _gemm_calls(device, pdtype, xdtype):
    """(name, call(backend), leaves) of each GEMM op's functional API on fresh inputs requiring
    grad."""
    k, h, n = 40, 72, 24
    p = lambda *s: (torch.randn(*s, device=device, dtype=pdtype) * s[-1] ** -0.5).requires_grad_()  # noqa: E731
    x = torch.randn(3, 5, k, device=device, dtype=xdtype, requires_grad=True)
    w1, b1, w2, b2, wu, bu = p(h, k), p(h), p(n, h), p(n), p(h, k), p(h)
    return [
        ("linear_act", lambda be: ampkernels.linear_act(x, w1, b1, "gelu_tanh", backend=be), (x, w1, b1)),
        ("linear_act no bias", lambda be: ampkernels.linear_act(x, w1, None, "relu", backend=be), (x, w1)),
        ("fused_mlp", lambda be: mlp_ops.fused_mlp(x, w1, b1, w2, b2, "gelu", backend=be), (x, w1, b1, w2, b2)),
        ("gated_linear_act", lambda be: ampkernels.gated_linear_act(x, w1, wu, b1, bu, "silu", backend=be),
         (x, w1, wu, b1, bu)),
        ("gated_mlp", lambda be: gla.gated_mlp(x, w1, wu, None, None, w2, b2, "gelu_tanh", backend=be),
         (x, w1, wu, w2, b2)),
    ]


def test_gemm_entry_declines_what_it_does_not_run():
    from ampkernels.ops import shared
    from ampkernels.ops.linear_act import BUCKET_BOUNDS as BOUNDS
    x, w = torch.randn(4, 8, dtype=torch.float16), torch.randn(16, 8, dtype=torch.float16)
    assert shared.gemm_entry(shared.LINEAR_ACT, x, (w, None), 3, None, {}, BOUNDS) is NotImplemented
    if not ampkernels.available_backends()["cuda"][0]:
        return
    xc, wc = x.cuda(), w.cuda()
    call = lambda x, params, act=3, backend=None, op=shared.LINEAR_ACT: shared.gemm_entry(  # noqa: E731
        op, x, params, act, backend, {}, BOUNDS)
    assert isinstance(call(xc, (wc, None)), torch.Tensor)
    with pytest.raises(TypeError):  # the table is a dict (key -> torch first), a bound per bucket but the last
        shared.gemm_entry(shared.LINEAR_ACT, xc, (wc, None), 3, None, frozenset(), BOUNDS)
    with pytest.raises(TypeError):
        shared.gemm_entry(shared.LINEAR_ACT, xc, (wc, None), 3, None, {}, BOUNDS[1:])
    # a listed cell: linear_act runs a torch-first one itself, any other op or cell declines
    key = shared.gemm_entry_key(3, torch.cuda.get_device_capability(xc.device)[0], torch.float16, "tiny", False)
    table_call = lambda op, params, table: shared.gemm_entry(  # noqa: E731
        op, xc, params, 3, None, table, BOUNDS)
    assert torch.equal(table_call(shared.LINEAR_ACT, (wc, None), {key: True}),
                       F.gelu(F.linear(xc, wc), approximate="tanh"))
    assert table_call(shared.LINEAR_ACT, (wc, None), {key: False}) is NotImplemented
    w2 = torch.randn(5, 16, dtype=torch.float16, device="cuda")
    for op, params in ((shared.FUSED_MLP, (wc, None, w2, None)), (shared.GATED_LINEAR_ACT, (wc, wc, None, None))):
        assert isinstance(table_call(op, params, {}), torch.Tensor)
        assert table_call(op, params, {key: True}) is NotImplemented

    class Sub(torch.Tensor):
        pass
    declined = [(xc[0], (wc, None)), (xc.t(), (wc, None)), (xc, (wc.t(), None)), (xc, (wc[:, :4], None)),
                (xc, (wc, wc[0])), (xc, (wc.double(), None)), (xc.float(), (wc, None)), (xc, (wc.float(), None)),
                (xc.as_subclass(Sub), (wc, None)), (xc, (wc.as_subclass(Sub), None)), (xc[:0], (wc, None)),
                (xc, (wc.cpu(), None))]
    for x_, params in declined:
        assert call(x_, params) is NotImplemented
    for act, backend in ((6, None), (-1, None), (3, "triton"), (3, "torch"), (3, 3), (3, "\udc80")):
        assert call(xc, (wc, None), act, backend) is NotImplemented
    assert call(xc, (wc, None, None, None), 1, op=shared.GATED_LINEAR_ACT) is NotImplemented  # relu is not gated
    # fp32 master weights take the kernels under autocast only
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = call(xc.float(), (wc.float(), None))
        assert out.dtype == torch.bfloat16
    with torch.overrides.TorchFunctionMode():
        assert call(xc, (wc, None)) is NotImplemented


@pytest.mark.gpu
@pytest.mark.parametrize("autocast", [False, True])
def test_gemm_entry_matches_the_full_path(monkeypatch, autocast):
    # the plain eager call of each GEMM op goes straight to the op: the same outputs and
    # gradients, bit for bit, as the Python path on the same arguments (backend "cuda": what the
    # entry runs), with 16-bit parameters or, under autocast, fp32 master weights and fp32 x
    from ampkernels.ops import shared
    torch.manual_seed(0)
    entry = shared.extension_gemm_entry()
    pdtype = torch.float32 if autocast else torch.bfloat16
    for name, call, leaves in _gemm_calls("cuda", pdtype, pdtype):
        taken = []
        monkeypatch.setattr(shared, "_gemm_entry", lambda *a: taken.append(entry(*a)) or taken[-1])
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            got = call("cuda")
            monkeypatch.setattr(shared, "_gemm_entry", shared._declined)
            want = call("cuda")
        assert len(taken) == 1 and taken[0] is got, name  # the entry ran the call
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), name
        g = torch.randn_like(got)
        for a, e in zip(torch.autograd.grad(got, leaves, g), torch.autograd.grad(want, leaves, g)):
            assert a.dtype == e.dtype and torch.equal(a, e), name


@pytest.mark.gpu
def test_gemm_entry_follows_the_auto_table(monkeypatch):
    # "auto" runs the cuda kernels from the entry only where linear_act's table puts them first:
    # on the H200, bf16 small training calls take eager torch for gelu_tanh and the kernels for
    # gelu, tiny ones (no cell measured) the kernels
    from ampkernels.ops import linear_act as la, shared
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the table's cells are the H200's")
    assert la.preference(torch.device("cuda"), torch.bfloat16, "gelu_tanh", "small", True) == ("torch",)
    assert la.preference(torch.device("cuda"), torch.bfloat16, "gelu", "small", True)[0] == "cuda"
    entry, taken = shared.extension_gemm_entry(), []
    monkeypatch.setattr(shared, "_gemm_entry", lambda *a: taken.append(entry(*a)) or taken[-1])
    x = torch.randn(4096, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # "small"
    w = torch.randn(3072, 768, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = ampkernels.linear_act(x, w, None, "gelu_tanh")
        kernel = ampkernels.linear_act(x, w, None, "gelu")
        with torch.no_grad():  # inference: cuda first for both
            inference = ampkernels.linear_act(x, w, None, "gelu_tanh")
        tiny = ampkernels.linear_act(x[:64], w[:512], None, "gelu_tanh")  # host-bound: the kernels
    # the torch cell runs from the entry too: F.linear + GELU, as the Python path runs it
    assert taken[0] is eager and eager.grad_fn.name() == "GeluBackward0"
    assert taken[1] is kernel and kernel.grad_fn.name() == "ampkernels::LinearActBackward"
    assert taken[2] is inference
    assert taken[3] is tiny and tiny.grad_fn.name() == "ampkernels::LinearActBackward"
    monkeypatch.setattr(shared, "_gemm_entry", shared._declined)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = ampkernels.linear_act(x, w, None, "gelu_tanh")
    assert want.grad_fn.name() == "GeluBackward0" and torch.equal(eager, want)
    g = torch.randn_like(eager)
    for a, e in zip(torch.autograd.grad(eager, (x, w), g), torch.autograd.grad(want, (x, w), g)):
        assert torch.equal(a, e)
