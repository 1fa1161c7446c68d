"""Parallel degrees of a run and the device meshes built from them.

    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=-1, cp=2, ep=1, world_size=8)
    meshes = dims.build_meshes("cuda")   # None for a single CPU process

Mesh dimensions, outermost first: dp_replicate (HSDP replicas) x dp_shard (FSDP shards) x cp (context
parallel: the ranks that split each row; innermost, so they are neighbours, on one node where they fit).
FSDP shards parameters over dp_shard x cp (flattened into one dimension) and replicates them over
dp_replicate. Data parallelism is dp_replicate x dp_shard: CP ranks of one data-parallel rank read the same
rows.

Expert parallelism (ep) is carved out of dp_shard x cp, innermost, as torchtitan does: the ep neighbouring ranks
of that flattened dimension split each MoE layer's experts, and FSDP shards the expert weights over what is left
of it (efsdp = dp_shard * cp / ep ranks, replicated over dp_replicate). ep is a multiple of cp: the EP group is
the CP group and ep / cp of its dp_shard neighbours, so the world mesh splits dp_shard into (efsdp, ep / cp).
Every group is then a dimension, or a flattening of adjacent ones, of one world mesh, as FSDP needs to shard
weights that EP already shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only when a mesh is built: config validation stays import-light
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Meshes:
    world: DeviceMesh  # (dp_replicate, dp_shard, cp)
    fsdp: DeviceMesh  # what fully_shard takes: (dp_shard_cp,) or (dp_replicate, dp_shard_cp) for HSDP
    cp: DeviceMesh | None  # the CP group of this rank (None without context parallelism)
    dp_rank: int  # this rank's data-parallel index: which rows it reads
    ep: DeviceMesh | None = None  # the EP group: ranks that split the experts (None without expert parallelism)
    expert_fsdp: DeviceMesh | None = None  # what fully_shard takes for expert weights: (efsdp,) or HSDP's 2-D


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    world_size: int

    @classmethod
    def resolve(cls, dp_replicate: int, dp_shard: int, cp: int, ep: int, world_size: int) -> ParallelDims:
        """Degrees with dp_shard = -1 resolved to the rest of the world; ValueError naming the degree at fault
        (messages use the config's key names) when they cannot tile `world_size` ranks."""
        for key, degree in [("data_parallel_replicate_degree", dp_replicate), ("context_parallel_degree", cp),
                            ("expert_parallel_degree", ep)]:
            if degree < 1:
                raise ValueError(f"parallelism.{key} must be >= 1, got {degree}")
        if dp_shard == -1:
            if world_size % (dp_replicate * cp):
                raise ValueError(
                    f"parallelism.data_parallel_shard_degree = -1 needs world size {world_size} divisible by "
                    f"data_parallel_replicate_degree * context_parallel_degree = {dp_replicate * cp}")
            dp_shard = world_size // (dp_replicate * cp)
        elif dp_shard < 1:
            raise ValueError(f"parallelism.data_parallel_shard_degree must be >= 1 or -1, got {dp_shard}")
        if dp_replicate * dp_shard * cp != world_size:
            raise ValueError(
                f"parallelism degrees multiply to {dp_replicate * dp_shard * cp} (replicate {dp_replicate} * "
                f"shard {dp_shard} * cp {cp}) but the world size is {world_size}")
        if (dp_shard * cp) % ep:
            raise ValueError(
                f"parallelism.expert_parallel_degree = {ep} must divide "
                f"data_parallel_shard_degree * context_parallel_degree = {dp_shard * cp}")
        if ep > 1 and ep % cp:
            raise ValueError(
                f"parallelism.expert_parallel_degree = {ep} must be a multiple of context_parallel_degree = {cp} "
                f"(the expert group is the CP group and some of its data-parallel neighbours)")
        return cls(dp_replicate, dp_shard, cp, ep, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different rows."""
        return self.dp_replicate * self.dp_shard

    def build_meshes(self, device_type: str) -> Meshes | None:
        """The meshes over the initialised default process group (None without one: a single CPU process)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from .torch_internals import flatten_mesh

        if not dist.is_initialized():
            return None
        r, d, c, ep = self.dp_replicate, self.dp_shard, self.cp, self.ep
        if ep == 1:
            world = init_device_mesh(device_type, (r, d, c), mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
            inner = ("dp_shard", "cp")
        else:  # the EP group: the CP group and ep / cp of its dp_shard neighbours
            world = init_device_mesh(device_type, (r, d * c // ep, ep // c, c),
                                     mesh_dim_names=("dp_replicate", "efsdp", "dp_shard_in_ep", "cp"))
            inner = ("efsdp", "dp_shard_in_ep", "cp")
        fsdp = flatten_mesh(world[inner], "dp_shard_cp")
        if r > 1:
            fsdp = world["dp_replicate", "dp_shard_cp"]
        ep_mesh = expert_fsdp = None
        if ep > 1:
            ep_mesh = flatten_mesh(world["dp_shard_in_ep", "cp"], "ep")
            expert_fsdp = world["dp_replicate", "efsdp"] if r > 1 else world["efsdp"]
        # CP is innermost, so the ranks of one data-parallel rank are consecutive: its index is rank // cp.
        return Meshes(world, fsdp, world["cp"] if c > 1 else None, dist.get_rank() // c, ep_mesh, expert_fsdp)
