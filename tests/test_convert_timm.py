"""convert() on timm models: norm subclasses and Mlp, each swap proven by the probe; what it leaves alone, and why."""
import copy

import pytest
import torch

import ampkernels.nn as aknn
from tests.utils import assert_rel_close

timm = pytest.importorskip("timm")
from timm.layers import GluMlp, LayerNorm2d, LayerNormFp32, Mlp, RmsNorm, SwiGLU  # noqa: E402

DEPTH = 2


def _vit():
    torch.manual_seed(0)  # vit_tiny_patch16_224's blocks (embed 192, 3 heads), 2 of them, on 32x32 images
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=DEPTH, img_size=32, patch_size=8,
                             num_classes=10)


def _images(n=4):
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _counts(report):
    counts = {}
    for _, old, new in report.replaced:
        counts[(old, new)] = counts.get((old, new), 0) + 1
    return counts


def test_vit_every_norm_and_mlp_fc1_gelu_replaced_outputs_match():
    ref = _vit().eval()
    model = copy.deepcopy(ref)
    norms_before = [p for p, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    params_before = {id(p) for p in model.parameters()}
    rng = torch.get_rng_state()
    _, report = aknn.convert(model)
    assert torch.equal(torch.get_rng_state(), rng)  # the probe replays the RNG, it does not advance it
    # 2 norms per block + the final norm; fc1 + GELU per block; the blocks' residual adds
    assert _counts(report) == {("LayerNorm", "LayerNorm"): 2 * DEPTH + 1, ("Linear", "Linear"): DEPTH,
                               ("Sequential", "FusedResidualBlocks"): 1}, str(report)
    assert report.skipped == [], str(report)
    assert sorted(p for p, _, new in report.replaced if new == "LayerNorm") == sorted(norms_before)
    for block in model.blocks:
        assert type(block.mlp.fc1) is aknn.Linear and block.mlp.fc1.activation == "gelu"
        assert type(block.mlp.act) is torch.nn.Identity
        assert type(block.norm1) is aknn.LayerNorm and block.norm1.eps == 1e-6
    assert not any(isinstance(m, torch.nn.GELU) for m in model.modules())
    assert {id(p) for p in model.parameters()} == params_before  # shared, never copied
    assert model.state_dict().keys() == ref.state_dict().keys()
    x = _images()
    with torch.no_grad():
        assert_rel_close(model(x), ref(x), torch.float32)
    assert str(report).splitlines()[1:3] == [
        "  blocks: torch.nn.modules.container.Sequential -> ampkernels.nn.modules.FusedResidualBlocks",
        "  blocks.0.norm1: timm.layers.norm.LayerNorm -> ampkernels.nn.modules.LayerNorm"]


def test_vit_trains_the_same_and_state_dict_loads_both_ways():
    ref = _vit().train()
    model = copy.deepcopy(ref)
    aknn.convert(model)
    x, y = _images(), torch.arange(4) % 10
    losses = {}
    for name, m in (("ref", ref), ("converted", model)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses[name] = []
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["converted"] == pytest.approx(losses["ref"], rel=1e-5, abs=1e-6)
    assert losses["ref"][-1] != losses["ref"][0]  # it did train

    fresh = _vit().eval()  # unconverted, different weights
    fresh.load_state_dict(model.state_dict())  # strict: same keys, same shapes
    model.eval()
    with torch.no_grad():
        assert_rel_close(model(x), fresh(x), torch.float32)
    back = copy.deepcopy(model)
    with torch.no_grad():
        for p in back.parameters():
            p.zero_()
    back.load_state_dict(fresh.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))


class ShiftedEpsLayerNorm(torch.nn.LayerNorm):
    """Claims to be a LayerNorm, uses its own eps: only the probe can tell."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, 1e-3)


class SameLayerNorm(torch.nn.LayerNorm):
    def forward(self, x):  # overridden, but the base operation
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def test_norm_subclasses_replaced_only_when_the_probe_shows_them_equal():
    model = torch.nn.Sequential(ShiftedEpsLayerNorm(16), SameLayerNorm(16, eps=1e-6), LayerNormFp32(16),
                                RmsNorm(16), LayerNorm2d(16))
    odd = model[0]
    _, report = aknn.convert(model)
    assert [(p, new) for p, _, new in report.replaced] == [("1", "LayerNorm"), ("2", "LayerNorm"), ("3", "RMSNorm")]
    assert model[0] is odd and model[1].eps == 1e-6 and model[3].eps == 1e-6
    skipped = {k.path: k for k in report.skipped}
    assert skipped["0"].cls == "tests.test_convert_timm.ShiftedEpsLayerNorm"
    assert skipped["0"].reason.startswith("probe: forward differs from the base operation")
    assert skipped["4"].reason == "channels-first (NCHW) norm, permutes around the op: not replaced"
    assert type(model[4]) is LayerNorm2d
    lines = str(report).splitlines()
    assert lines[0] == "ampkernels.nn.convert: 3 module(s) replaced"
    assert lines[4] == "ampkernels.nn.convert: 2 module(s) recognised but left alone"
    assert lines[5].startswith("  0: tests.test_convert_timm.ShiftedEpsLayerNorm (probe: ")


def test_mlp_dropout_after_the_activation_still_fuses_fc1():
    # Mlp.forward is fc1 -> act -> drop1 -> norm -> fc2: drop1 (p=0.1) and a norm come after the
    # activation, so fc1 + act fuse and they stay where they are; train-mode output is the same mask
    ref = Mlp(16, 64, drop=0.1, norm_layer=torch.nn.LayerNorm).train()
    mlp = copy.deepcopy(ref)
    model = torch.nn.Sequential(mlp)
    _, report = aknn.convert(model)
    assert [(p, new) for p, _, new in report.replaced] == [("0.fc1", "Linear"), ("0.norm", "LayerNorm")]
    assert report.skipped == [] and mlp.drop1.p == 0.1 and type(mlp.act) is torch.nn.Identity
    x = torch.randn(3, 7, 16)
    torch.manual_seed(5)
    want = ref(x)
    torch.manual_seed(5)
    assert_rel_close(mlp(x), want, torch.float32)


def test_mlps_left_alone_with_reasons():
    model = torch.nn.Sequential(GluMlp(16, 64), SwiGLU(16, 32, drop=0.1), Mlp(16, 32, act_layer=torch.nn.Tanh),
                                Mlp(16, 32, use_conv=True), Mlp(16, 32))
    model[4].fc1.register_forward_pre_hook(lambda *a: None)
    before = copy.deepcopy(model)
    _, report = aknn.convert(model)
    assert report.replaced == []
    assert [(k.path, k.cls, k.reason) for k in report.skipped] == [
        ("0", "timm.layers.mlp.GluMlp",
         "gated MLP with activation torch.nn.modules.activation.Sigmoid: no fused equivalent"),
        ("1", "timm.layers.mlp.SwiGLU", "gated MLP with dropout before fc2: not fused"),
        ("2", "timm.layers.mlp.Mlp", "activation torch.nn.modules.activation.Tanh: no fused equivalent"),
        ("3", "timm.layers.mlp.Mlp", "fc1 is Conv2d (use_conv=True or custom): no fused op for it"),
        ("4", "timm.layers.mlp.Mlp", "Linear has hooks, which a swap would drop")]
    assert str(report).splitlines()[0] == "ampkernels.nn.convert: nothing replaced; model unchanged"
    for a, b in zip(model.modules(), before.modules()):
        assert type(a) is type(b)
    x = torch.randn(2, 5, 16)
    model.eval(), before.eval()
    for m, b in zip(model[:3], before[:3]):
        assert torch.equal(m(x), b(x))


class ScaledMlp(Mlp):
    def forward(self, x):  # a subclass doing more than Mlp: the probe sees it
        return super().forward(x) * 0.5 + x


class ReorderedMlp(Mlp):
    def forward(self, x):  # the activation no longer on fc1's output
        return self.fc2(self.act(self.fc1(x) + 1))


def test_mlp_subclasses_are_probed():
    model = torch.nn.Sequential(ScaledMlp(16, 32, out_features=16), ReorderedMlp(16, 32))
    ref = copy.deepcopy(model)
    _, report = aknn.convert(model)
    assert [p for p, _, _ in report.replaced] == ["0.fc1"]  # Mlp.forward inside, the extra ops around it
    assert [(k.path, k.reason.split(" (")[0]) for k in report.skipped] == [
        ("1", "probe: forward differs from the base operation")]
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert_rel_close(model(x), ref(x), torch.float32)


def _vit_with_layer_scale(depth=3, drop_path=0.0):
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=depth, img_size=32, patch_size=8,
                             num_classes=10, init_values=0.1, drop_path_rate=drop_path)


def _loss_and_grads(model, x, y, seed=3):
    torch.manual_seed(seed)  # drop_path draws the same masks in both runs
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_vit_blocks_run_their_residual_adds_inside_the_norms():
    # LayerScale and drop path on: the branch each norm adds is ls(drop_path(...)) as in Block.forward
    ref = _vit_with_layer_scale(drop_path=0.2).train()
    model = copy.deepcopy(ref)
    aknn.convert(model, norm_out_dtype="autocast")
    assert type(model.blocks) is aknn.FusedResidualBlocks and len(model.blocks) == 3
    assert all(type(b) is type(ref.blocks[0]) for b in model.blocks)  # the blocks themselves, kept
    assert model.state_dict().keys() == ref.state_dict().keys()
    calls = []
    for b in model.blocks:  # every norm after the first takes the add
        for n in (b.norm1, b.norm2):
            n.forward_residual = (lambda f: lambda *a: calls.append(1) or f(*a))(n.forward_residual)
    x, y = _images(), torch.arange(4) % 10
    want_loss, want = _loss_and_grads(ref, x, y)
    loss, got = _loss_and_grads(model, x, y)
    assert len(calls) == 5
    assert_rel_close(loss, want_loss, torch.float32)
    for name, g in want.items():
        assert_rel_close(got[name], g, torch.float32, what=name)
    # iterated (gradient checkpointing runs the blocks one by one): the blocks' own forward, unfused
    model.set_grad_checkpointing(True)
    calls.clear()
    loss, got = _loss_and_grads(model, x, y)
    assert calls == []
    assert_rel_close(loss, want_loss, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the fp32 stream's sums as torch's adds make them
        ref.eval(), model.eval()
        torch.testing.assert_close(model.forward_features(x).float(), ref.forward_features(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "offset_rms_norm"])
def test_norm_forward_residual_sum_and_output_dtypes(kind):
    make = {"layer_norm": lambda: aknn.LayerNorm(24, eps=1e-6), "rms_norm": lambda: aknn.RMSNorm(24, eps=1e-6),
            "offset_rms_norm": lambda: aknn.OffsetRMSNorm(24, eps=1e-6)}[kind]
    norm = make()
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    g = torch.Generator().manual_seed(2)
    for xdt, rdt in ((torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.float16, torch.bfloat16),
                     (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float64)):
        x = torch.randn(3, 5, 24, generator=g).to(xdt)
        r = torch.randn(3, 5, 24, generator=g).to(rdt)
        s_want = r + x
        for out_dtype in (None, torch.float16):
            norm.out_dtype = out_dtype
            out, s = norm.forward_residual(x, r)
            assert s.dtype == s_want.dtype and out.dtype == (out_dtype or s_want.dtype), (xdt, rdt, out_dtype)
            assert torch.equal(s, s_want)  # the add torch makes, bit for bit
            torch.testing.assert_close(out.double(), norm(s_want).double(), rtol=2e-2, atol=2e-2)
    norm.out_dtype = "autocast"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, s = norm.forward_residual(torch.randn(2, 24).bfloat16(), torch.randn(2, 24))
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32


class NotQuiteBlock(timm.models.vision_transformer.Block):
    def forward(self, x, **kw):  # a subclass: by its exact class, never fused
        return super().forward(x) * 0.5


def test_blocks_left_alone_with_reasons():
    hooked = _vit_with_layer_scale(depth=2)
    hooked.blocks[1].norm2.register_forward_hook(lambda *a: None)
    _, report = aknn.convert(hooked)
    assert type(hooked.blocks) is torch.nn.Sequential
    assert [(k.path, k.reason) for k in report.skipped] == [
        ("blocks", "blocks whose norms were not all replaced: residual adds not fused"),
        ("blocks.1.norm2", "LayerNorm has hooks, which a swap would drop")], str(report)
    seen = []
    watched = _vit_with_layer_scale(depth=2)  # a hook on a module the fused forward calls still runs
    watched.blocks[1].attn.register_forward_hook(lambda *a: seen.append(1))
    aknn.convert(watched)
    assert type(watched.blocks) is aknn.FusedResidualBlocks
    seen.clear()
    watched(_images())
    assert seen == [1]
    plain = _vit_with_layer_scale(depth=2)
    _, report = aknn.convert(plain, norms=False)  # the fusion lives in the norms: none without them
    assert type(plain.blocks) is torch.nn.Sequential and report.skipped == []
    patched = _vit_with_layer_scale(depth=2)
    patched.blocks[0].forward = patched.blocks[0].forward
    _, report = aknn.convert(patched)
    assert type(patched.blocks) is torch.nn.Sequential
    assert [(k.path, k.reason) for k in report.skipped] == [("blocks", "Block.forward is patched on the instance")]
    sub = _vit_with_layer_scale(depth=2)
    sub.blocks[0].__class__ = NotQuiteBlock
    _, report = aknn.convert(sub)
    assert type(sub.blocks) is torch.nn.Sequential and report.skipped == []


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_vit_blocks_fused_residuals_match_under_autocast(backend, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    ref = _vit_with_layer_scale(depth=3).cuda().train()
    unfused = copy.deepcopy(ref)
    aknn.convert(unfused, backend=backend, norm_out_dtype="autocast")
    model = copy.deepcopy(unfused)
    unfused.blocks = torch.nn.Sequential(*unfused.blocks)  # the same kernels, the adds apart
    assert type(model.blocks) is aknn.FusedResidualBlocks
    x, y = _images(8).cuda(), (torch.arange(8) % 10).cuda()
    results = []
    for m in (ref, unfused, model):
        with torch.autocast("cuda", dtype=dtype):
            results.append(_loss_and_grads(m, x, y))
    (want_loss, want), (plain_loss, plain), (loss, got) = results
    assert_rel_close(loss, want_loss.double(), dtype, factor=2)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-3, atol=1e-4)  # only the adds' placement differs
    flat = lambda grads: torch.cat([grads[n].flatten() for n in want])  # noqa: E731
    assert_rel_close(flat(got), flat(want).double(), dtype, factor=4, what="all gradients against unconverted")
    for name in want:  # against the same conversion with the adds apart: the same sums, so close to the bit
        assert got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], plain[name], rtol=2e-2, atol=1e-3 * plain[name].abs().max().item())


def test_fused_residual_blocks_compile_fullgraph_as_the_blocks():
    # under torch.compile "auto" hands the norms to inductor: the fused adds trace as plain adds
    ref = _vit_with_layer_scale(depth=2).eval()
    model = copy.deepcopy(ref)
    aknn.convert(model, norm_out_dtype="autocast")
    x = _images()
    outs = []
    for m in (ref, model):
        torch._dynamo.reset()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append(torch.compile(m, fullgraph=True)(x).float())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
