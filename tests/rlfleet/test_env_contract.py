"""rlfleet.wire.env_contract: how every version's EnvSpec and responses are read, and that the doc it points to has the
sections it names and documents every check of the kit."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from rlfleet.simulators import conformance
from rlfleet.v1 import env_pb2, tensor_pb2
from rlfleet.wire import codec, env_contract

DOC = (Path(__file__).resolve().parents[2] / env_contract.DOC).read_text()


def _anchor(title: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title.strip().lower()))


def test_every_section_the_code_names_exists_in_the_doc():
    anchors = {_anchor(m) for m in re.findall(r"^#+ (.+)$", DOC, re.M)}
    missing = {name: a for name, a in env_contract._ANCHORS.items() if a not in anchors}
    assert not missing, (missing, sorted(anchors))


def test_the_doc_documents_every_check_and_its_count():
    table = DOC.split("## Checking a server")[1]
    assert [n for n in conformance.Checker.NAMES if f"\n| {n} |" not in table] == []
    assert f"{len(conformance.Checker.NAMES)} checks" in DOC


def _spec(**fields) -> env_pb2.EnvSpec:
    spec = env_pb2.EnvSpec(**{"env_id": "T", "num_envs": 2, "max_episode_steps": 5, **fields})
    spec.observation_space["state"].CopyFrom(tensor_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=[3]))
    spec.action_space.CopyFrom(tensor_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=[2], low=-1, high=1))
    return spec


def test_zero_values_of_later_fields_read_as_their_defaults():
    v = env_contract.read(_spec())
    assert (v.version, v.max_action_chunk, v.max_step_streams, v.streams_stated, v.num_reset_states, v.simulator) == (
        "0",
        1,
        1,
        False,
        0,
        "external",
    )
    assert not v.lists_final_rows and env_contract.spec_problems(_spec()) == []
    v = env_contract.read(_spec(contract_version="1", max_action_chunk=4, max_step_streams=3, simulator="mine"))
    assert (v.version, v.max_action_chunk, v.max_step_streams, v.streams_stated, v.simulator) == (
        "1",
        4,
        3,
        True,
        "mine",
    )


def test_what_a_run_cannot_use_is_named_with_its_section():
    assert env_contract.run_problems(_spec(contract_version="1", max_action_chunk=2), policy_chunk=2) == []
    (why,) = env_contract.run_problems(_spec(contract_version="1"), policy_chunk=4)
    assert why.startswith(
        "EnvSpec.max_action_chunk is 0 (0 reads as 1); the policy acts in chunks of 4"
    ) and why.endswith("(docs/env-contract.md#action-chunks)")
    bad = _spec(contract_version="2", max_episode_steps=0)
    bad.action_space.dtype = tensor_pb2.FLOAT64
    problems = env_contract.spec_problems(bad)
    assert [p.split(" ")[0] for p in problems] == [
        "EnvSpec.contract_version",
        "EnvSpec.max_episode_steps",
        "EnvSpec.action_space",
    ], problems


def _final(rows: int) -> tensor_pb2.TensorMap:
    return codec.encode_map({"state": np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)})


def test_final_observations_in_each_accepted_form():
    specs = dict(_spec().observation_space)
    rows = np.array([1, 3])
    only = env_contract.decode_final_observations(_final(2), rows, 4, specs)["state"]
    every = env_contract.decode_final_observations(_final(4), rows, 4, specs)["state"]
    assert only.shape == every.shape == (2, 3) and every[0, 0] == 3.0 and every[1, 0] == 9.0  # rows 1 and 3 picked
    none = env_contract.decode_final_observations(tensor_pb2.TensorMap(), np.array([], np.int64), 4, specs)
    assert none["state"].shape == (0, 3) and none["state"].dtype == np.float32
    assert env_contract.decode_final_observations(_final(0), np.array([], np.int64), 4, specs)["state"].shape == (0, 3)
    with pytest.raises(codec.CodecError, match=r"final_observations\['state'\]: shape \[4, 3\] where \[2, 3\]"):
        env_contract.decode_final_observations(_final(4), rows, 4, specs, every_row_ok=False)
    with pytest.raises(codec.CodecError, match=r"shape \[3, 3\] where \[2, 3\]"):
        env_contract.decode_final_observations(_final(3), rows, 4, specs)


def test_version_0_ended_rows_come_from_the_flags():
    term = np.array([False, True, False, False])
    trunc = np.array([False, False, False, True])
    assert env_contract.ended_rows([], term, trunc, env_contract.read(_spec())).tolist() == [1, 3]
    v1 = env_contract.read(_spec(contract_version="1"))
    assert env_contract.ended_rows([3], term, trunc, v1).tolist() == [3]
