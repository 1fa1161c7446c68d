"""Parallel degrees of a run and the device meshes built from them.

    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=-1, cp=2, ep=1, world_size=8)
    meshes = dims.build_meshes("cuda")   # None for a single CPU process

Mesh dimensions, outermost first: dp_replicate (HSDP replicas) x dp_shard (FSDP shards) x cp (context
parallel: the ranks that split each row; innermost, so they are neighbours, on one node where they fit).
FSDP shards parameters over dp_shard x cp (flattened into one dimension) and replicates them over
dp_replicate. Data parallelism is dp_replicate x dp_shard: CP ranks of one data-parallel rank read the same
rows. Expert parallelism is validated here already (carved out of dp_shard x cp), not built yet.
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
        return cls(dp_replicate, dp_shard, cp, ep, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different rows."""
        return self.dp_replicate * self.dp_shard

    def build_meshes(self, device_type: str) -> Meshes | None:
        """The meshes over the initialised default process group (None without one: a single CPU process)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            return None
        world = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.cp),
                                 mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
        shard_cp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
        fsdp = shard_cp if self.dp_replicate == 1 else world["dp_replicate", "dp_shard_cp"]
        dp_rank = world["dp_replicate"].get_local_rank() * self.dp_shard + world["dp_shard"].get_local_rank()
        return Meshes(world, fsdp, world["cp"] if self.cp > 1 else None, dp_rank)
