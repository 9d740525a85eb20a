"""PyTorch's distributed peers of the benches: the same GPT under FSDP2 (``fully_shard``, for
``hpcpar bench zero``) or DDP (for ``hpcpar bench roofline``) over gloo.

PyTorch is a peer, never a dependency: imported here only, when the bench asks for it. Every
rank of the MPI world joins one gloo process group on loopback (127.0.0.1, a port rank 0
picked and broadcast; ``GLOO_SOCKET_IFNAME=lo`` so gloo binds nothing else).
"""
from __future__ import annotations

import os
import socket

import numpy as np

from ..nn.gpt import GPTConfig
from .step import torch_gpt


def join_gloo(world) -> str | None:
    """Start torch.distributed over gloo on loopback for the ranks of ``world``; None, or why it cannot."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as err:
        return f"PyTorch is not installed ({err})"
    if dist.is_initialized():
        return None
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = world.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=world.Get_rank(), world_size=world.Get_size())
    except Exception as err:  # noqa: BLE001 - the peer's own failure is reported, not raised
        return f"gloo did not start: {type(err).__name__}: {err}"
    return None


def fsdp_step(config: GPTConfig, ids: np.ndarray, clip: float, reshard_after_forward: bool, world):
    """(one AdamW training step of the GPT under FSDP2 on ``ids`` (B, T + 1), None), or (None, why)."""
    problem = join_gloo(world)
    if problem:
        return None, problem
    import torch
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(config.seed)
        model = torch_gpt(config)
        mesh = init_device_mesh("cpu", (world.Get_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    except Exception as err:  # noqa: BLE001
        return None, f"fully_shard failed: {type(err).__name__}: {err}"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs, targets = torch.from_numpy(ids[:, :-1]), torch.from_numpy(ids[:, 1:])

    def step():
        loss = model(inputs, targets)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()

    return step, None


def ddp_step(config: GPTConfig, batch: int, world):
    """(one AdamW training step of the GPT under DDP on a fresh ``batch`` of its own per rank, None),
    or (None, why); at one rank the plain model (what DDP of one process would wrap)."""
    try:
        import torch
    except ImportError as err:
        return None, f"PyTorch is not installed ({err})"
    problem = join_gloo(world) if world.Get_size() > 1 else None
    if problem:
        return None, problem
    from .step import torch_step

    if world.Get_size() == 1:
        return torch_step(config, batch), None
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(config.seed)
    model = DistributedDataParallel(torch_gpt(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng([world.Get_rank(), 1])

    def step():
        ids = torch.from_numpy(rng.integers(0, config.vocab_size, (batch, config.block_size + 1)))
        model(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, None
