"""Parallel degrees of a run and the device mesh built from them.

    dims = ParallelDims.resolve(dp_replicate=1, dp_shard=-1, cp=1, ep=1, world_size=8)
    mesh = dims.build_mesh("cuda")   # None for a single CPU process

Mesh dimensions, outermost first: dp_replicate (HSDP replicas) x dp_shard (FSDP shards). Context and expert
parallelism are validated here already (cp joins the mesh, ep is carved out of dp_shard x cp) so a config is
checked once, whatever this build runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only when a mesh is built: config validation stays import-light
    from torch.distributed.device_mesh import DeviceMesh


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

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The FSDP mesh over the initialised default process group (None without one: a single CPU process)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            return None
        if self.dp_replicate == 1:
            return init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
