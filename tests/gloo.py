"""Gloo process groups on 127.0.0.1 for the distributed tests (torch alone, no toolkit)."""

import datetime
import os
import socket

import torch
import torch.distributed as dist


def init_gloo(rank: int, world_size: int, port: int) -> None:
    """Join a CPU process group on 127.0.0.1 (one thread per rank)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))


def init_dp_cp(rank: int, world_size: int, cp: int, port: int):
    """A gloo group of ``world_size`` one-thread ranks laid out as (data parallel, context parallel):
    rank = dp_rank · cp + cp_rank. Returns (dp_rank, cp_rank, cp_group, dp_group)."""
    init_gloo(rank, world_size, port)
    dp_size = world_size // cp
    dp_rank, cp_rank = divmod(rank, cp)
    cp_groups = [dist.new_group([d * cp + c for c in range(cp)]) for d in range(dp_size)]
    dp_groups = [dist.new_group([d * cp + c for d in range(dp_size)]) for c in range(cp)]
    return dp_rank, cp_rank, cp_groups[dp_rank], dp_groups[cp_rank]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
