"""DistributedDataParallel and FSDP2 with ampkernels modules: one process per GPU, NCCL,
one GradScaler per process. Runs on a machine with >= 2 GPUs; skips elsewhere.

Each rank trains a converted model on its shard of a fixed batch; the result must match
a single-process run of the unconverted model on the whole batch (gradients averaged)."""
import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu
WORLD = min(torch.cuda.device_count(), 4)
needs_2 = pytest.mark.skipif(WORLD < 2, reason="needs >= 2 GPUs")
DTYPE = {"ddp": torch.float16, "fsdp2": torch.bfloat16}  # DDP with a GradScaler per process; FSDP2 in bf16


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(128), torch.nn.Linear(128, 512), torch.nn.GELU(approximate="tanh"),
                               torch.nn.Linear(512, 128), torch.nn.RMSNorm(128))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8 * WORLD, 128, generator=g), torch.randn(8 * WORLD, 128, generator=g)


def _train(model, x, y, steps=5, dtype=torch.float16):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    losses = []
    for _ in range(steps):
        with torch.autocast("cuda", dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _worker(rank, mode, port, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torch.distributed.init_process_group("nccl", rank=rank, world_size=WORLD)
    torch.cuda.set_device(rank)
    import ampkernels.nn as aknn
    model = _model().cuda()
    aknn.convert(model)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if any(p.requires_grad for p in layer.parameters(recurse=False)):
                fully_shard(layer)
        fully_shard(model)
    x, y = _data()
    shard = slice(rank * 8, (rank + 1) * 8)
    losses = _train(model, x[shard].cuda(), y[shard].cuda(), dtype=DTYPE[mode])
    torch.distributed.all_reduce(losses)
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"losses": (losses / WORLD).cpu(), "state": state}, result_path)
    torch.distributed.destroy_process_group()


@needs_2
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_matches_single_process(mode, tmp_path):
    path = str(tmp_path / "result.pt")
    mp.spawn(_worker, args=(mode, 29500 + (mode == "fsdp2"), path), nprocs=WORLD, join=True)
    result = torch.load(path)
    x, y = _data()
    ref = _model().cuda()
    # the mean of per-rank losses on equal shards == the loss on the whole batch; grads likewise
    ref_losses = _train(ref, x.cuda(), y.cuda(), dtype=DTYPE[mode])
    assert torch.allclose(result["losses"], ref_losses.cpu(), rtol=2e-2, atol=1e-3), (result["losses"], ref_losses)
    for k, v in ref.state_dict().items():
        key = k if k in result["state"] else "module." + k
        assert torch.allclose(result["state"][key].float(), v.float().cpu(), rtol=2e-2, atol=2e-3), k
