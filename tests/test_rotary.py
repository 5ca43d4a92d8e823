"""rotary_embedding: every backend against the fp64 reference (Hugging Face's formula), forward
and backward, over dtype mixes of q/k, cos/sin and out_dtype, both layouts (heads before or after
the sequence), GQA (fewer k heads), strided and offset inputs, a cos batch of 1 or B; errors and
routing; the C++ node's lifecycle; the Hugging Face integration (fuse_rotary): scoping to the
marked modules, the probe that leaves other rotaries alone, checkpointing, and a converted LLaMA
against the unconverted one."""
import types

import pytest
import torch

import ampkernels
from ampkernels import _extension, backends, reference
from ampkernels.integrations import rotary as ak_rotary
from tests.utils import assert_rel_close, randn

HAS_CUDA = torch.cuda.is_available()
# CPU: the Triton kernel under the interpreter (fp16/fp32 there); GPU: both kernel backends, in
# the GPU tier (`pytest -m gpu`)
KERNEL_BACKENDS = [pytest.param(b, marks=pytest.mark.gpu) for b in ("cuda", "triton")] if HAS_CUDA else ["triton"]
DEVICE = "cuda" if HAS_CUDA else "cpu"
X_DTYPES = [torch.float16, torch.bfloat16, torch.float32] if HAS_CUDA else [torch.float16, torch.float32]


def _inputs(b, hq, hk, s, d, x_dtype, cs_dtype, layout, cos_batch, device=DEVICE):
    """q, k (requiring grad) in `layout` ("bhsd": heads before the sequence, unsqueeze_dim 1, made
    as HF does: a (b, s, h*d) projection viewed and transposed; "bshd": unsqueeze_dim 2) and
    cos/sin (cos_batch, s, d) of random angles."""
    def make(h):
        t = randn(b, s, h * d, dtype=x_dtype, device=device).view(b, s, h, d)
        return (t.transpose(1, 2) if layout == "bhsd" else t).detach().requires_grad_()
    angle = randn(cos_batch, s, d, device=device, scale=3.0)
    return make(hq), make(hk), angle.cos().to(cs_dtype), angle.sin().to(cs_dtype), 1 if layout == "bhsd" else 2


def _reference(q, k, cos, sin, u, dq_out, dk_out):
    """fp64 outputs and input gradients."""
    qd, kd = (t.detach().double().requires_grad_() for t in (q, k))
    q_ref, k_ref = reference.rotary_embedding(qd, kd, cos.double(), sin.double(), u)
    torch.autograd.backward((q_ref, k_ref), (dq_out.double(), dk_out.double()))
    return q_ref.detach(), k_ref.detach(), qd.grad, kd.grad


def _check(backend, q, k, cos, sin, u, out_dtype=None):
    q_out, k_out = ampkernels.rotary_embedding(q, k, cos, sin, u, out_dtype=out_dtype, backend=backend)
    promoted = torch.promote_types(q.dtype, cos.dtype)
    assert q_out.dtype == (out_dtype or promoted) and k_out.dtype == (out_dtype or promoted)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    assert dq.dtype == q.dtype and dk.dtype == k.dtype
    q_ref, k_ref, dq_ref, dk_ref = _reference(q, k, cos, sin, u, dq_out, dk_out)
    # the kernels round once to each output's dtype; torch's formula rounds each op (factor 2)
    assert_rel_close(q_out, q_ref, factor=2, what="q_out")
    assert_rel_close(k_out, k_ref, factor=2, what="k_out")
    assert_rel_close(dq, dq_ref, factor=2, what="dq")
    assert_rel_close(dk, dk_ref, factor=2, what="dk")


def _runs(backend):
    if backend == "torch":
        return
    why = backends._can_run(backend, torch.device(DEVICE))
    if why is None and not _extension.load():
        why = f"the extension (the op) is not built: {_extension.status()[1]}"
    if why is not None:
        pytest.skip(why)


@pytest.mark.parametrize("backend", ["torch"] + KERNEL_BACKENDS)
@pytest.mark.parametrize("x_dtype", X_DTYPES)
@pytest.mark.parametrize("cs_fp32", [True, False])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_matches_reference(backend, x_dtype, cs_fp32, layout):
    _runs(backend)
    q, k, cos, sin, u = _inputs(2, 4, 2, 7, 16, x_dtype, torch.float32 if cs_fp32 else x_dtype, layout, cos_batch=2)
    _check(backend, q, k, cos, sin, u)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32] + ([torch.bfloat16] if HAS_CUDA else []))
@pytest.mark.parametrize("x_dtype", X_DTYPES)
def test_out_dtype(backend, out_dtype, x_dtype):
    """Any out_dtype, against the fp64 reference: under autocast 16-bit q with fp32 cos asks for
    the autocast dtype (the integration), fp32 for the formula's own dtype."""
    _runs(backend)
    q, k, cos, sin, u = _inputs(3, 2, 1, 5, 8, x_dtype, torch.float32, "bhsd", cos_batch=1)
    _check(backend, q, k, cos, sin, u, out_dtype)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (2, 3, 1, 33, 6), (1, 5, 5, 9, 128), (2, 2, 2, 3, 256)],
                         ids=str)
def test_odd_shapes(backend, shape):
    """Head dims whose half is not a power of two (3, 33 rows), the smallest (2), the largest
    LLaMA-family ones; one row; cos batch 1 against q's batch."""
    _runs(backend)
    if len(shape) == 4:
        b, hq, s, d = shape
        hk = hq
    else:
        b, hq, hk, s, d = shape
    q, k, cos, sin, u = _inputs(b, hq, hk, s, d, torch.float16, torch.float32, "bhsd", cos_batch=1)
    _check(backend, q, k, cos, sin, u)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_strided_offset_inputs(backend):
    """q and k sliced out of one fused qkv projection (a storage offset, a row stride wider than
    the heads), cos/sin sliced from a longer table: read where they are, never wrongly."""
    _runs(backend)
    b, s, h, d = 2, 6, 3, 8
    qkv = randn(b, s, 3 * h * d, dtype=torch.float16, device=DEVICE)
    q = qkv[..., : h * d].view(b, s, h, d).transpose(1, 2).detach().requires_grad_()
    k = qkv[..., h * d: 2 * h * d].view(b, s, h, d).transpose(1, 2).detach().requires_grad_()
    angle = randn(1, s + 4, 2 * d, device=DEVICE)
    cos, sin = angle.cos()[:, 2: s + 2, :d], angle.sin()[:, 2: s + 2, d:]
    assert not cos.is_contiguous() and q.storage_offset() == 0 and k.storage_offset() == h * d
    _check(backend, q, k, cos, sin, 1)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_inputs_unchanged_and_no_grad(backend):
    _runs(backend)
    q, k, cos, sin, u = _inputs(2, 2, 2, 4, 8, torch.float16, torch.float32, "bhsd", cos_batch=2)
    before = [t.detach().clone() for t in (q, k, cos, sin)]
    with torch.no_grad():
        q_out, k_out = ampkernels.rotary_embedding(q, k, cos, sin, u, backend=backend)
    assert not q_out.requires_grad and not k_out.requires_grad
    for t, b in zip((q, k, cos, sin), before):
        assert torch.equal(t.detach(), b)
    with torch.inference_mode():
        q_inf, _ = ampkernels.rotary_embedding(q.detach(), k.detach(), cos, sin, u, backend=backend)
    assert torch.equal(q_inf, q_out)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_node_lifecycle(backend):
    """The C++ node: only the inputs that require grad get one; an unused output's gradient is
    zero; retain_graph allows a second backward, without it the saved cos/sin are freed; a
    saved-tensor hook sees cos and sin; forward-mode AD is refused."""
    _runs(backend)
    q, k, cos, sin, u = _inputs(1, 2, 1, 3, 8, torch.float32, torch.float32, "bhsd", cos_batch=1)
    k_plain = k.detach()
    q_out, k_out = ampkernels.rotary_embedding(q, k_plain, cos, sin, u, backend=backend)
    assert q_out.requires_grad and q_out.grad_fn.name() == "ampkernels::RotaryBackward"
    g = torch.randn_like(q_out)
    (dq,) = torch.autograd.grad(q_out, q, g, retain_graph=True)
    (dq2,) = torch.autograd.grad(q_out, q, g)
    assert torch.equal(dq, dq2)
    with pytest.raises(RuntimeError, match="backward through the graph a second time|freed"):
        torch.autograd.grad(q_out, q, g)
    q_out, k_out = ampkernels.rotary_embedding(q, k, cos, sin, u, backend=backend)
    (dk,) = torch.autograd.grad(k_out.sum(), k)  # q_out unused: its gradient is taken as zero
    kd = k.detach().double().requires_grad_()
    _, k_ref = reference.rotary_embedding(q.detach().double(), kd, cos.double(), sin.double(), u)
    (dk_ref,) = torch.autograd.grad(k_ref.sum(), kd)
    assert_rel_close(dk, dk_ref, torch.float32, what="dk")
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
        q_out, _ = ampkernels.rotary_embedding(q, k, cos, sin, u, backend=backend)
    assert sorted(seen) == [cos.shape, sin.shape]
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        ampkernels.rotary_embedding(fwAD.make_dual(q.detach(), torch.ones_like(q)), k, cos, sin, u, backend=backend)


def test_errors_name_the_argument():
    q, k, cos, sin, u = _inputs(1, 2, 1, 3, 8, torch.float32, torch.float32, "bhsd", cos_batch=1, device="cpu")
    with pytest.raises(TypeError, match="cos must be a Tensor"):
        ampkernels.rotary_embedding(q, k, 1.0, sin)
    with pytest.raises(ValueError, match="cos and sin must have one shape"):
        ampkernels.rotary_embedding(q, k, cos, sin[:, :2])
    with pytest.raises(ValueError, match="even last dim"):
        ampkernels.rotary_embedding(q[..., :7], k[..., :7], cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="even last dim"):
        ampkernels.rotary_embedding(q, k, cos[..., :4], sin[..., :4])
    with pytest.raises(TypeError, match="floating-point"):
        ampkernels.rotary_embedding(q.detach().long(), k, cos, sin)
    with pytest.raises(ValueError, match="out_dtype"):
        ampkernels.rotary_embedding(q, k, cos, sin, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="unsqueeze_dim"):
        ampkernels.rotary_embedding(q, k, cos, sin, 1.5)
    with pytest.raises(ValueError, match="backend"):
        ampkernels.rotary_embedding(q, k, cos, sin, backend="nope")


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_what_the_kernels_do_not_take(backend):
    """"auto" runs the torch formula for what the kernels do not take (cos requiring grad, 3-D q,
    fp64), with gradients for cos too; asking a kernel backend for it is an error naming why."""
    _runs(backend)
    q, k, cos, sin, u = _inputs(1, 2, 1, 3, 8, torch.float32, torch.float32, "bhsd", cos_batch=1)
    cos_g = cos.detach().requires_grad_()
    q_out, _ = ampkernels.rotary_embedding(q, k, cos_g, sin, u)
    (dcos,) = torch.autograd.grad(q_out.sum(), cos_g)
    assert dcos.shape == cos.shape and dcos.abs().sum() > 0
    with pytest.raises(RuntimeError, match="cos or sin requires grad"):
        ampkernels.rotary_embedding(q, k, cos_g, sin, u, backend=backend)
    with pytest.raises(RuntimeError, match="4-D q and k"):
        ampkernels.rotary_embedding(q[0], k[0], cos, sin, 0, backend=backend)
    out3, _ = ampkernels.rotary_embedding(q[0], k[0], cos, sin, 0)  # "auto": the formula, any rank
    assert torch.equal(out3, reference.rotary_embedding(q[0], k[0], cos, sin, 0)[0])
    with pytest.raises(RuntimeError, match="float64"):
        ampkernels.rotary_embedding(q.double(), k.double(), cos.double(), sin.double(), u, backend=backend)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_opcheck(backend):
    _runs(backend)
    q, k, cos, sin, u = _inputs(2, 2, 1, 5, 8, torch.bfloat16, torch.float32, "bhsd", cos_batch=2)
    torch.library.opcheck(torch.ops.ampkernels.rotary_embedding.default,
                          (q, k, cos, sin, u, torch.float32, torch.bfloat16, backend))
    torch.library.opcheck(getattr(torch.ops.ampkernels, f"rotary_{backend}").default,
                          (q.detach(), cos, sin, u, torch.bfloat16, True))


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_compile_fullgraph(backend):
    """Under torch.compile "auto" traces the formula (inductor fuses it); an explicit backend
    keeps the op, traced through its fake; both match eager."""
    _runs("cuda")
    q, k, cos, sin, u = _inputs(2, 4, 2, 9, 16, torch.bfloat16, torch.float32, "bhsd", cos_batch=1)
    fn = lambda q, k: ampkernels.rotary_embedding(q, k, cos, sin, u, backend=backend)  # noqa: E731
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True)(q, k)
    want = fn(q, k)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_rel_close(a, b.double(), torch.bfloat16)


# ---------------------------------------------------------------- the Hugging Face integration

_INTERLEAVED = '''
import torch

def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    def rot(x):  # GPT-J's pairs (0, 1), (2, 3), ...: not the rotate-half form
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rot(q) * sin, k * cos + rot(k) * sin

class Attention(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)
'''


def test_fuse_rotary_leaves_other_rotaries_alone():
    mod = types.ModuleType("interleaved_rotary_model")
    exec(_INTERLEAVED, mod.__dict__)  # noqa: S102 - a model file of the test's own
    from ampkernels.nn.convert import ConvertReport
    report = ConvertReport()
    assert ak_rotary.fuse_rotary(torch.nn.Sequential(mod.Attention()), report) == 0
    assert mod.apply_rotary_pos_emb.__module__ == "interleaved_rotary_model"
    assert "not the rotate-half rotary embedding" in report.skipped[0].reason


def _tiny_llama(seed=0, layers=2):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def test_fuse_rotary_scoped_to_marked_modules(monkeypatch):
    """The fused op runs in the marked model's attention only: an unconverted model of the same
    class in the same process keeps Hugging Face's function; a second fuse_rotary is a no-op."""
    calls = []
    real = ak_rotary.rotary_embedding
    monkeypatch.setattr(ak_rotary, "rotary_embedding", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    model, plain = _tiny_llama(), _tiny_llama()
    assert ak_rotary.fuse_rotary(model) == 2 and ak_rotary.fuse_rotary(model) == 0
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        a, b = model(ids).logits, plain(ids).logits
    assert len(calls) == 2
    torch.testing.assert_close(a, b)
    calls.clear()
    with torch.no_grad():
        plain(ids)
    assert not calls and not getattr(ak_rotary._STATE, "stack", [])


def test_apply_fuses_rotary_and_trains_the_same():
    """integrations.transformers.apply: the report counts the fused attention modules; a training
    step's loss and gradients match the unconverted model's, with activation checkpointing too
    (its recomputation re-enters the marked forward)."""
    from ampkernels.integrations import transformers as ak_hf
    model, plain = _tiny_llama(layers=3), _tiny_llama(layers=3)
    report = ak_hf.apply(model, fuse_loss=False, norms=False, linears=False)
    assert report.fused_rotary == 3 and "rotary embedding fused in 3" in str(report)
    ids = torch.randint(0, 64, (2, 7))
    for m in (model, plain):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    losses = [m(ids, labels=ids).loss for m in (model, plain)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_converted_llama_on_gpu_under_autocast():
    """On the kernels under bf16 autocast: q and k leave the op in bf16 (HF's formula gives fp32,
    which sdpa casts to bf16), the loss and gradients match the unconverted model's."""
    from ampkernels.integrations import transformers as ak_hf
    model, plain = _tiny_llama(layers=2).cuda(), _tiny_llama(layers=2).cuda()
    ak_hf.apply(model, fuse_loss=False, norms=False, linears=False)
    ids = torch.randint(0, 64, (2, 33), device="cuda")
    losses = []
    for m in (model, plain):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses.append(m(ids, labels=ids).loss)
        losses[-1].backward()
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert_rel_close(p.grad, q.grad.double(), torch.bfloat16, factor=4, what=name)


def test_fused_rotary_traces_without_graph_breaks():
    """Under torch.compile the marked forward's hooks and the dispatcher trace away (the original
    function runs, for inductor to fuse): no graph break that the unconverted model does not have."""
    model = _tiny_llama()
    ak_rotary.fuse_rotary(model)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randint(0, 64, (2, 5)))
    assert explained.graph_break_count == 0, explained.break_reasons
