"""Launcher environment detection, with the variables each launcher really sets."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from hvdkit.environments import (
    LocalEnvironment,
    OpenMPIEnvironment,
    SlurmEnvironment,
    TorchrunEnvironment,
    detect_environment,
    expand_nodelist,
)
from hvdkit.errors import LauncherEnvError

SLURM = {"SLURM_JOB_ID": "1234567", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3",
         "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[007-008,010],cpu1"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}


@pytest.mark.parametrize("nodelist,expected", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[007-008,010],cpu1", ["gpu007", "gpu008", "gpu010", "cpu1"]),
    ("rack[1-2]-n[3-4]", ["rack1-n3", "rack1-n4", "rack2-n3", "rack2-n4"]),
    ("a,b[09-10]", ["a", "b09", "b10"]),
])
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


def test_expand_nodelist_rejects_garbage():
    with pytest.raises(LauncherEnvError, match="unbalanced"):
        expand_nodelist("node[1-2")
    with pytest.raises(LauncherEnvError, match="cannot parse range"):
        expand_nodelist("node[a-b]")


@mock.patch.dict(os.environ, SLURM, clear=True)
def test_slurm_environment():
    env = detect_environment()
    assert isinstance(env, SlurmEnvironment)
    assert (env.global_rank(), env.world_size(), env.local_rank()) == (3, 8, 1)
    assert env.main_address == "gpu007"
    assert env.main_port == 15000 + 4567  # derived from the job id: every task agrees


@mock.patch.dict(os.environ, {**SLURM, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400"}, clear=True)
def test_slurm_master_addr_override():
    env = detect_environment()
    assert (env.main_address, env.main_port) == ("10.0.0.5", 29400)


@mock.patch.dict(os.environ, {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}, clear=True)
def test_sbatch_shell_without_srun_is_not_a_slurm_task():
    # The batch script itself has SLURM_PROCID=0 and SLURM_NTASKS=8; it is not rank 0 of 8.
    assert isinstance(detect_environment(), LocalEnvironment)


@mock.patch.dict(os.environ, {**SLURM, **OMPI}, clear=True)
def test_mpirun_inside_allocation_wins_over_slurm():
    env = detect_environment()
    assert isinstance(env, OpenMPIEnvironment)
    assert (env.global_rank(), env.world_size(), env.local_rank()) == (1, 2, 1)


@mock.patch.dict(os.environ, {**OMPI, "RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h",
                              "MASTER_PORT": "1"}, clear=True)
def test_torchrun_variables_win():
    env = detect_environment()
    assert isinstance(env, TorchrunEnvironment)
    assert (env.world_size(), env.local_rank(), env.main_address, env.main_port) == (4, 0, "h", 1)


@mock.patch.dict(os.environ, {}, clear=True)
def test_no_launcher_is_local():
    env = detect_environment()
    assert (env.name, env.world_size(), env.global_rank()) == ("local", 1, 0)
    assert env.main_address == "127.0.0.1" and env.main_port > 0


@pytest.mark.parametrize("variables,match", [
    ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "x"}, "rank 3 is outside world size 2"),
    ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_ADDR": "x"}, "world size is 0"),
    ({"RANK": "one", "WORLD_SIZE": "2", "MASTER_ADDR": "x"}, "RANK='one' is not an integer"),
    ({**OMPI, "OMPI_COMM_WORLD_RANK": "2"}, "rank 2 is outside world size 2"),
    ({**SLURM, "SLURM_LOCALID": "5"}, "local rank 5 is impossible for global rank 3"),
])
def test_inconsistent_environment_is_one_line_error(variables, match):
    with mock.patch.dict(os.environ, variables, clear=True):
        with pytest.raises(LauncherEnvError, match=match) as info:
            detect_environment()
    assert "\n" not in str(info.value) and "HINT:" in str(info.value)


def test_forced_unknown_environment():
    with pytest.raises(LauncherEnvError, match="unknown launcher environment 'k8s'"):
        detect_environment("k8s", environ={})


def test_forced_environment_reads_given_mapping():
    env = detect_environment("openmpi", environ=OMPI)
    assert env.global_rank() == 1


@pytest.mark.parametrize("env, rank", [
    ({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4"}, 3),                                    # horovodrun (Gloo)
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}, 2),                    # mpirun
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, 1),                                            # srun --mpi=pmi2
    ({"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8"}, 5),              # srun
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, 0),                                    # the batch shell
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "n1"}, 1),                         # torchrun
    # torchrun's variables win over Slurm's, as in detect_environment (the old copy asked Slurm last
    # but PMI before torchrun)
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "n1", "PMI_RANK": "0", "PMI_SIZE": "2"}, 1),
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "4"}, 0),                    # broken: reported later
    ({}, 0),
])
def test_launcher_rank_is_the_detected_environments_rank(env, rank):
    from hvdkit.environments import launcher_rank

    assert launcher_rank(env) == rank


def test_ranks_share_their_nodes_cores_unless_omp_num_threads_is_set():
    """A rank takes its node's usable cores over the ranks on that node; OMP_NUM_THREADS wins."""
    import socket

    import torch

    from hvdkit.backends import base

    before = torch.get_num_threads()
    here = socket.gethostname()
    try:
        with mock.patch.dict(os.environ), mock.patch.object(base, "usable_cores", return_value=6):
            os.environ.pop("OMP_NUM_THREADS", None)
            assert base.share_node_cores([here, here, "elsewhere"]) == 3  # 2 ranks here share 6 cores
            assert base.share_node_cores([here, here, here, here, here, here, here]) == 1  # never 0
            os.environ["OMP_NUM_THREADS"] = "1"
            torch.set_num_threads(2)
            assert base.share_node_cores([here]) == 2  # the user's setting stands: untouched
    finally:
        torch.set_num_threads(before)
