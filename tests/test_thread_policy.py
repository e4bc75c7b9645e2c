"""vllm.thread_policy: importing vllm changes nothing; the OpenMP policy is derived from the CPUs
this process may use, applied where engine processes start, and a user's setting wins.

The subprocess tests read what libgomp itself parsed (OMP_DISPLAY_ENV=VERBOSE prints it when
the library loads): GOMP_SPINCOUNT is 0 under PASSIVE, 300000 by default, 3e10 under ACTIVE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm import thread_policy
from vllm.thread_policy import ThreadPolicy, available_cpus, derive

OMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")
PASSIVE_SPIN = "GOMP_SPINCOUNT = '0'"
ACTIVE_SPIN = "GOMP_SPINCOUNT = '30000000000'"


def run_python(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Runs script in a fresh interpreter without the OMP_* variables, plus `env`."""
    full = {k: v for k, v in os.environ.items() if k not in OMP_VARS and k != "OMP_DISPLAY_ENV"}
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", script], env=full, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return proc


def last_json(proc: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ derive


def test_available_cpus_is_the_affinity_mask() -> None:
    assert available_cpus() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("processes", "cpus", "want"),
    [
        (1, 2, ThreadPolicy(2, "PASSIVE")),
        (1, 64, ThreadPolicy(64, "PASSIVE")),
        (2, 8, ThreadPolicy(4, "PASSIVE")),
        (3, 8, ThreadPolicy(2, "PASSIVE")),
        (4, 2, ThreadPolicy(1, "PASSIVE")),  # more workers than CPUs: one thread each
        (0, 4, ThreadPolicy(4, "PASSIVE")),
    ],
)
def test_threads_split_the_cpus_among_the_processes(
    processes: int, cpus: int, want: ThreadPolicy
) -> None:
    assert derive(processes, environ={}, cpus=cpus) == want


def test_user_values_win() -> None:
    user = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert derive(1, environ=user, cpus=8) == ThreadPolicy(3, "ACTIVE")
    assert derive(2, environ={"OMP_WAIT_POLICY": "passive"}, cpus=8) == ThreadPolicy(4, "passive")
    # Nested teams: the outer count is this process's.
    assert derive(1, environ={"OMP_NUM_THREADS": "6,2"}, cpus=8).num_threads == 6


def test_spare_cpus_keep_the_openmp_default() -> None:
    # A team that leaves a CPU free for the engine's own threads may spin.
    assert derive(1, environ={"OMP_NUM_THREADS": "3"}, cpus=8) == ThreadPolicy(3, None)
    assert derive(2, environ={"OMP_NUM_THREADS": "3"}, cpus=8) == ThreadPolicy(3, None)
    assert derive(2, environ={"OMP_NUM_THREADS": "4"}, cpus=8).wait_policy == "PASSIVE"
    assert ThreadPolicy(3, None).env() == {"OMP_NUM_THREADS": "3"}


def test_unusable_thread_counts_are_derived_instead() -> None:
    for value in ("", "0", "-2", "many"):
        assert derive(1, environ={"OMP_NUM_THREADS": value}, cpus=4).num_threads == 4


# ------------------------------------------------------------------------------ child_env


def test_child_env_sets_the_policy_only_while_children_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in OMP_VARS:
        monkeypatch.delenv(key, raising=False)
    before = dict(os.environ)
    with thread_policy.child_env(1) as policy:
        assert policy == derive(1, environ={})
        assert {k: os.environ[k] for k in OMP_VARS} == policy.env()
        # Inherits os.environ as it is now, as a spawned process does.
        child = subprocess.run(
            [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
            capture_output=True, text=True, timeout=60, check=True,
        )
    assert dict(os.environ) == before
    seen = json.loads(child.stdout)
    assert {k: seen.get(k) for k in OMP_VARS} == {
        "OMP_NUM_THREADS": str(available_cpus()),
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def test_child_env_keeps_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with thread_policy.child_env(2):
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
        assert os.environ["OMP_NUM_THREADS"] == str(max(1, available_cpus() // 2))
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_NUM_THREADS" not in os.environ


# ------------------------------------------------------------------------------ import


_IMPORT_SCRIPT = """
import json, os
before = dict(os.environ)
import vllm
from vllm import LLM, CompletionOutput, RequestOutput, SamplingParams, StructuredOutputsParams
import vllm._custom_ops, vllm.thread_policy, vllm.entrypoints.cli.main
light = dict(os.environ) == before
from vllm.thread_policy import openmp_loaded
openmp_before_engine = openmp_loaded()
import vllm.engine.arg_utils, vllm.v1.engine.core_proc, vllm.v1.executor.multiproc_executor
import vllm.v1.worker.gpu_worker
print(json.dumps({"light": light, "openmp": openmp_before_engine,
                  "all": dict(os.environ) == before}))
"""


def test_importing_vllm_changes_no_environment() -> None:
    got = last_json(run_python(_IMPORT_SCRIPT))
    assert got == {"light": True, "openmp": False, "all": True}


# ------------------------------------------------------------------------------ in process


_CONFIGURE_SCRIPT = """
import json, os
before = dict(os.environ)
from vllm import thread_policy
policy = thread_policy.configure_process()
assert thread_policy.configure_process() is policy
import torch
print(json.dumps({"threads": torch.get_num_threads(), "same_env": dict(os.environ) == before,
                  "policy": [policy.num_threads, policy.wait_policy]}))
"""


def test_configure_process_applies_the_policy_before_openmp_loads() -> None:
    proc = run_python(_CONFIGURE_SCRIPT, OMP_DISPLAY_ENV="VERBOSE")
    cpus = available_cpus()
    assert last_json(proc) == {"threads": cpus, "same_env": True, "policy": [cpus, "PASSIVE"]}
    assert PASSIVE_SPIN in proc.stderr
    assert f"OMP_NUM_THREADS = '{cpus}'" in proc.stderr


def test_configure_process_keeps_the_users_values() -> None:
    proc = run_python(_CONFIGURE_SCRIPT, OMP_DISPLAY_ENV="VERBOSE", OMP_WAIT_POLICY="ACTIVE",
                      OMP_NUM_THREADS="1")
    assert last_json(proc) == {"threads": 1, "same_env": True, "policy": [1, "ACTIVE"]}
    assert ACTIVE_SPIN in proc.stderr


def test_configure_process_warns_when_openmp_is_already_loaded() -> None:
    proc = run_python("import torch\n" + _CONFIGURE_SCRIPT, OMP_DISPLAY_ENV="VERBOSE")
    assert "GOMP_SPINCOUNT = '300000'" in proc.stderr
    assert "set OMP_WAIT_POLICY=PASSIVE" in proc.stderr
    # Set by the user: nothing to warn about.
    quiet = run_python("import torch\n" + _CONFIGURE_SCRIPT, OMP_WAIT_POLICY="PASSIVE")
    assert "OMP_WAIT_POLICY" not in quiet.stderr


_LLM_SCRIPT = """
import json, os
before = dict(os.environ)
from vllm import LLM, SamplingParams
llm = LLM("demo-tiny", max_model_len=64, max_num_seqs=2)
out = llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
import torch
print(json.dumps({"threads": torch.get_num_threads(), "same_env": dict(os.environ) == before,
                  "tokens": len(out[0].outputs[0].token_ids)}))
llm.shutdown()
"""


@pytest.mark.timeout(240)
def test_offline_llm_sets_the_policy_before_torch_loads() -> None:
    proc = run_python(_LLM_SCRIPT, OMP_DISPLAY_ENV="VERBOSE")
    assert last_json(proc) == {"threads": available_cpus(), "same_env": True, "tokens": 2}
    assert PASSIVE_SPIN in proc.stderr


@pytest.mark.parametrize("cpus, threads", [(1, 2), (2, 2), (6, 3), (16, 8), (64, 8)])
def test_helper_threads_take_half_the_cpus_within_bounds(
    monkeypatch: pytest.MonkeyPatch, cpus: int, threads: int
) -> None:
    monkeypatch.setattr(thread_policy, "available_cpus", lambda: cpus)
    assert thread_policy.helper_threads() == threads
