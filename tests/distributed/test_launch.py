import pytest

from verl_mcore.distributed.launch import LaunchError, detect_launch, expand_nodelist


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("gpu[001-004,007],login1", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007", "login1"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("a[1-2],b[01-02,5]", ["a1", "a2", "b01", "b02", "b5"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("gpu-a100-[3,1]", ["gpu-a100-3", "gpu-a100-1"]),
    ("x1,x2, x3", ["x1", "x2", "x3"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[1-3", "gpu1-3]", "gpu[5-2]", "gpu[a-b]"])
def test_expand_nodelist_rejects(bad):
    with pytest.raises(LaunchError, match="nodelist"):
        expand_nodelist(bad)


def test_torchrun_env():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "host0", "MASTER_PORT": "1234",
           # inside an sbatch allocation torchrun still wins
           "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 4)
    assert (info.master_addr, info.master_port, info.launcher) == ("host0", 1234, "torchrun")


def test_slurm_env():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "123456"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (9, 16, 1, 8)
    assert info.master_addr == "gpu007" and info.launcher == "slurm"
    assert info.master_port == 20000 + 123456 % 20000
    # an explicit MASTER_ADDR/PORT from the sbatch script wins
    info = detect_launch({**env, "MASTER_ADDR": "ib-gpu007", "MASTER_PORT": "6000"})
    assert (info.master_addr, info.master_port) == ("ib-gpu007", 6000)


def test_slurm_tasks_per_node_compact_form():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_STEPID": "0",
           "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODELIST": "c[1-2]"}
    info = detect_launch(env)
    assert info.local_world_size == 4 and info.master_addr == "c1"


def test_slurm_batch_step_is_not_a_rank():
    # The batch script itself (no srun step) must not pose as rank 0 of SLURM_NTASKS ranks.
    info = detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"})
    assert info.launcher == "single" and info.world_size == 1


def test_slurm_without_nodelist_fails_clearly():
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        detect_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "1"})


def test_openmpi_env_with_master():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "MASTER_ADDR": "h0", "MASTER_PORT": "7000"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert (info.master_addr, info.master_port, info.launcher) == ("h0", 7000, "mpi")


class _FakeComm:
    """mpi4py COMM_WORLD stand-in: bcast returns what root 0 announced."""

    def __init__(self, rank, announced):
        self.rank, self.announced = rank, announced

    def Get_rank(self):
        return self.rank

    def bcast(self, obj, root=0):
        assert root == 0
        return obj if self.rank == 0 else self.announced


def test_pmi_env_broadcasts_master_from_rank0():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4"}
    info = detect_launch(env, mpi_comm=_FakeComm(2, ("rank0-host", 31337)))
    assert (info.rank, info.world_size, info.master_addr, info.master_port) == (2, 4, "rank0-host", 31337)
    info0 = detect_launch({"PMI_RANK": "0", "PMI_SIZE": "4"}, mpi_comm=_FakeComm(0, None))
    assert info0.rank == 0 and info0.master_port > 0


def test_single_process_default():
    info = detect_launch({})
    assert (info.rank, info.world_size, info.launcher) == (0, 1, "single") and info.master_port > 0
    assert detect_launch({"MASTER_PORT": "4321"}).master_port == 4321


def test_bad_integer_names_variable():
    with pytest.raises(LaunchError, match="WORLD_SIZE='eight'"):
        detect_launch({"RANK": "0", "WORLD_SIZE": "eight"})


def _init_over_callers_group(rank, world_size, device):
    from verl_mcore.distributed.launch import detect_launch, init_distributed

    try:
        return init_distributed(detect_launch(), device)
    except LaunchError as e:
        return str(e)


def test_a_callers_process_group_of_the_wrong_backend_is_refused_before_any_model():
    # The rank's group is gloo (run_on_ranks): trainer.device=cuda would put CUDA tensors in
    # gloo's collectives (a segfault in megatron's coalesced all-gather); refused naming both.
    from tests.multiproc import run_on_ranks

    [message] = run_on_ranks(_init_over_callers_group, 1, args=("cuda",), timeout=120)
    assert message.startswith("trainer.device=cuda computes on cuda, which needs the nccl backend, "
                              "but torch.distributed was initialised with 'gloo'"), message
    assert "torch " in message and "initialise it with 'nccl', or leave it to the trainer" in message
    # The matching device keeps the caller's group.
    assert run_on_ranks(_init_over_callers_group, 1, args=("cpu",), timeout=120) == ["cpu"]
