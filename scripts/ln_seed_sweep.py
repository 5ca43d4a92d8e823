"""test_gpu_sizes (tests/test_layer_norm.py, Triton backend, N 768..1536) over many input seeds in
one process, each seeded as AMPKERNELS_TEST_SEED=k would seed it: how often each case fails,
and the first failures' messages. GPU only.
    python scripts/ln_seed_sweep.py [SEEDS]
"""
import sys

import torch

sys.path.insert(0, ".")
# conftest first (it sets up the environment the test module's kernels are defined in)
from tests.conftest import input_seed

# isort: split
from tests import test_layer_norm as t

salts = int(sys.argv[1]) if len(sys.argv) > 1 else 100
for n in (768, 1000, 1024, 1536):
    for is_rms in (False, True):
        nid = f"tests/test_layer_norm.py::test_gpu_sizes[{is_rms}-{n}-triton]"
        fails = 0
        for k in range(salts):
            torch.manual_seed(input_seed(nid, k))
            try:
                t.test_gpu_sizes("triton", n, is_rms)
            except AssertionError as e:
                fails += 1
                if fails <= 6:
                    print(f"{nid} salt {k}: {str(e).splitlines()[0][:400]}", flush=True)
        print(f"{nid}: {fails} of {salts} salts failed", flush=True)
