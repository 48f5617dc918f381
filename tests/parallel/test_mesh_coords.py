"""Where a rank sits in a mesh, known without the mesh (split mode's generators deal each
data-parallel rank's groups to the trainers by it): `mesh_coords` and `dp_ranks` against the
coordinates torch reads off the mesh's rank tensor, laid out as `build_mesh` lays it."""

from __future__ import annotations

import itertools

import pytest
import torch

from tandem.parallel.mesh import AXES, Degrees, dp_ranks, mesh_coords


@pytest.mark.parametrize(
    "sizes", [(1, 1, 2, 1, 1), (1, 2, 2, 1, 1), (2, 1, 2, 1, 2), (1, 2, 3, 2, 2), (2, 2, 1, 1, 2)]
)
def test_coordinates_and_dp_ranks_match_the_mesh_layout(sizes):
    degrees = Degrees(**dict(zip(AXES, sizes, strict=True)))
    ranks = torch.arange(degrees.world_size).view(sizes)  # DeviceMesh's rank tensor
    for idx in itertools.product(*(range(n) for n in sizes)):
        rank = int(ranks[idx])
        want = dict(zip(AXES, idx, strict=True))
        assert mesh_coords(degrees, rank) == want
        # replicate-major, as tandem.parallel.mesh.dp_rank reads it off a live mesh
        assert dp_ranks(degrees)[rank] == want["dp_replicate"] * degrees.dp_shard + want["dp_shard"]
    assert sorted(set(dp_ranks(degrees))) == list(range(degrees.dp))
