"""convert()'s report: model order, module-qualified class names, the fused activation."""
import torch

import ampkernels.nn as aknn


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.ln_f = torch.nn.LayerNorm(16)  # a norm of the root: convert's walk meets it first


def test_report_lists_replacements_in_model_order_with_qualified_names_and_activation():
    _, report = aknn.convert(Model())
    assert [d.path for d in report.details] == ["blocks.0.ln", "blocks.0.mlp.0", "blocks.1.ln", "blocks.1.mlp.0",
                                               "ln_f"]
    assert [r[0] for r in report.replaced] == [d.path for d in report.details]
    lines = str(report).splitlines()
    assert lines[0] == "ampkernels.nn.convert: 5 module(s) replaced"
    assert lines[1] == "  blocks.0.ln: torch.nn.modules.normalization.LayerNorm -> ampkernels.nn.modules.LayerNorm"
    assert lines[2] == ("  blocks.0.mlp.0: torch.nn.modules.linear.Linear -> ampkernels.nn.modules.Linear"
                        " (fused activation: silu)")
    assert lines[-1].startswith("  ln_f: ")


def test_report_lists_what_was_left_alone_after_the_replacements():
    model = Model()
    model.blocks[0].ln.register_forward_hook(lambda *a: None)  # a swap would drop it
    model.blocks[1].mlp[0].register_forward_pre_hook(lambda *a: None)
    _, report = aknn.convert(model)
    assert [d.path for d in report.details] == ["blocks.0.mlp.0", "blocks.1.ln", "ln_f"]
    assert [(k.path, k.reason) for k in report.skipped] == [
        ("blocks.0.ln", "LayerNorm has hooks, which a swap would drop"),
        ("blocks.1.mlp.0", "Linear has hooks, which a swap would drop")]
    lines = str(report).splitlines()
    assert lines[4] == "ampkernels.nn.convert: 2 module(s) recognised but left alone"
    assert lines[5] == ("  blocks.0.ln: torch.nn.modules.normalization.LayerNorm"
                        " (LayerNorm has hooks, which a swap would drop)")


def test_meta_device_swaps_only_what_is_equal_by_construction():
    class Sub(torch.nn.LayerNorm):  # torch's forward, inherited
        pass

    class Own(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x)

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.LayerNorm(8), Sub(8), Own(8), torch.nn.RMSNorm(8))
    _, report = aknn.convert(model)
    assert [d.path for d in report.details] == ["0", "1", "3"]
    assert [(k.path, k.reason) for k in report.skipped] == [("2", "parameters on the meta device: cannot probe")]
