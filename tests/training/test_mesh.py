"""The mesh is the one home of the degrees: its rank layout is the one the runtimes use (DeepSpeed's consecutive
tensor- and sequence-parallel groups, accelerate's dp_replicate x dp_shard order, the pipeline's pp outermost), and
it is where a degree that does not divide the launched ranks is refused."""

import pytest

from training.mesh import AXES, Mesh, MeshError
from training.paths import ROOT
from training.strategy import Strategy


def test_ranks_are_row_major_with_pp_outermost_and_tp_innermost():
    mesh = Mesh(pp=2, dp_replicate=1, dp_shard=2, sp=1, tp=2)
    assert mesh.world == 8
    assert [mesh.coordinates(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [mesh.coordinates(r)["dp_shard"] for r in range(8)] == [0, 0, 1, 1] * 2
    assert [mesh.coordinates(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4
    for rank in range(8):
        assert mesh.rank(**mesh.coordinates(rank)) == rank
    assert tuple(mesh.shape) == AXES


def test_groups_are_the_ones_each_runtime_builds():
    mesh = Mesh(pp=2, dp_shard=2, tp=2)
    assert mesh.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # consecutive, as DeepSpeed AutoTP's
    assert mesh.groups("dp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # rank r and r + world / pp: neighbouring stages
    assert mesh.group_of(5, "dp_replicate", "dp_shard") == [5, 7]
    hybrid = Mesh(dp_replicate=2, dp_shard=2)
    assert hybrid.groups("dp_shard") == [[0, 1], [2, 3]]  # accelerate's HSDP: shards inside a replica
    assert [hybrid.dp_rank(r) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="choose among"):
        mesh.groups("dp")


def test_the_mesh_matches_the_strategies_rank_arithmetic():
    """The data-parallel, sequence-parallel and pipeline ranks the loader and the pipeline take come from the mesh,
    laid out as the launchers place the ranks."""
    ulysses = Strategy.of("deepspeed", 8, zero_stage=3, sp=2)
    assert [ulysses.sequence_parallel_rank(r) for r in range(8)] == [0, 1] * 4  # consecutive: DeepSpeed's groups
    assert [ulysses.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    pipeline = Strategy.of("ddp", 4, pp=2)
    assert [pipeline.pipeline_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [pipeline.data_parallel_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert pipeline.mesh == Mesh(pp=2, dp_replicate=2)  # DDP replicates
    assert Strategy.of("fsdp", 4, fsdp_version=2, replicas=2).mesh == Mesh(dp_replicate=2, dp_shard=2)
    assert Strategy.of("fsdp", 4, fsdp_version=2, replicas=2).shard_size == 2


@pytest.mark.parametrize(
    ("world", "degrees", "message"),
    [
        (3, {"pp": 2}, "--pipeline_parallel_degree = 2 does not divide the 3 launched ranks: set it to one of [1, 3]"),
        (4, {"pp": 2, "cp": 3}, "--pipeline_parallel_degree = 2 x parallelism_config_cp_size = 3 (= 6 ranks) does not "
                                "divide the 4 launched ranks: make their product one of [1, 2, 4]"),
        (6, {"tp": 4}, "tensor_parallel.autotp_size = 4 does not divide the 6 launched ranks"),
    ],
)  # fmt: skip
def test_degrees_that_do_not_divide_the_world_are_refused_naming_each(world, degrees, message):
    """One check for every launch: the message names each setting the user gave, its value and the fix (a pipeline
    degree beside ring context parallelism is named as given, not multiplied into the other)."""
    with pytest.raises(MeshError) as err:
        Mesh.of_world(world, **degrees)
    assert message in str(err.value)


@pytest.mark.parametrize("degree", [0, -1, 1.5, True])
def test_a_degree_below_one_or_not_whole_is_refused(degree):
    with pytest.raises(ValueError, match="--pipeline_parallel_degree: .* is not a degree: set a whole number"):
        Mesh(pp=degree)


def test_other_degrees_rebuild_the_mesh_on_the_same_ranks():
    zero = Strategy.of("deepspeed", 8, zero_stage=1, sp=2)
    assert zero.with_degrees(sp=1).mesh == Mesh(dp_shard=8)
    assert zero.with_degrees(16).mesh == Mesh(dp_shard=8, sp=2)
    with pytest.raises(MeshError, match="sequence_parallel_size = 2 x tensor_parallel.autotp_size = 4"):
        zero.with_degrees(tp=4, world=4)


def test_the_yaml_block_is_read_in_one_place_from_the_launch_or_the_file(tmp_path):
    """What `accelerate launch` exports of a parallelism_config block, and the same made by accelerate's own
    launcher code from the YAML file."""
    from training.environment import Environment

    environ = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2",
               "PARALLELISM_CONFIG_SP_SIZE": "2"}  # fmt: skip
    env = Environment.read(environ)
    assert env.block == {"dp_shard_size": "2", "sp_size": "2"}
    assert env.block_degree("sp_size") == 2 and env.block_degree("cp_size") == 1
    assert Environment.read({}).block is None and Environment.read({}).block_degree("dp_shard_size", default=8) == 8
    with pytest.raises(ValueError, match="parallelism_config_sp_size is '0': set a whole number"):
        Environment.read({**environ, "PARALLELISM_CONFIG_SP_SIZE": "0"}).block_degree("sp_size")
    yaml = tmp_path / "sp.yaml"
    yaml.write_text((ROOT / "accelerate_configs" / "zero2_sp.yaml").read_text())
    launched = Environment.of_accelerate_config(yaml)
    assert (launched.world, launched.deepspeed, launched.block_degree("sp_size")) == (2, True, 2)


def test_other_degrees_keep_the_family_s_data_parallel_kind():
    """`with_degrees` places the data-parallel ranks as `Strategy.of` does: replicated outside FSDP and ZeRO."""
    single = Strategy.of("single", 2, pp=2)
    assert single.with_degrees(4).mesh == Mesh(pp=2, dp_replicate=2) == Strategy.of("single", 4, pp=2).mesh
    assert Strategy.of("ddp", 2).with_degrees(4).mesh == Mesh(dp_replicate=4)
