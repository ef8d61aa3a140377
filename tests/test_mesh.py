"""The named mesh: validated once against the world size, coordinates and groups by pure arithmetic."""

import pytest

from loom.mesh import Mesh, MeshShape
from loom.topology import Topology

pytestmark = pytest.mark.unit


@pytest.mark.timeout(10)
def test_product_must_equal_world_size_and_the_error_names_everything():
    with pytest.raises(
        ValueError, match=r"mesh dp=3 × pp=2 × tp=1 needs 6 processes, but the world size is 4"
    ):
        Mesh(dp=3, pp=2, topology=Topology(0, 4, 0, 4, "gloo"))
    with pytest.raises(ValueError, match="mesh degree tp must be an int >= 1, got 0"):
        MeshShape(tp=0)


@pytest.mark.timeout(10)
def test_tp_varies_fastest_and_groups_partition_the_world():
    shape = MeshShape(dp=2, pp=2, tp=2)
    assert [shape.coordinates(r) for r in (0, 1, 2, 5)] == [
        {"dp": 0, "pp": 0, "tp": 0},
        {"dp": 0, "pp": 0, "tp": 1},
        {"dp": 0, "pp": 1, "tp": 0},
        {"dp": 1, "pp": 0, "tp": 1},
    ]
    assert all(shape.rank_at(**shape.coordinates(r)) == r for r in range(8))
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for axis in ("dp", "pp", "tp"):
        assert sorted(r for g in shape.groups(axis) for r in g) == list(range(8))
    assert shape.ranks_along("pp", 5) == [5, 7]


@pytest.mark.timeout(10)
def test_single_process_mesh_and_data_topology():
    mesh = Mesh(topology=Topology(0, 1, 0, 1, "none"))
    assert mesh.group("dp") is None and mesh.index("pp") == 0 and mesh.peer("pp", 0) == 0
    data = mesh.data_topology()
    assert (data.rank, data.world_size) == (0, 1)
    with pytest.raises(ValueError, match="mesh axis must be one of 'dp', 'pp', 'tp', got 'ep'"):
        mesh.size("ep")
