"""Shape checks of what games and trainers send, against what they announced: pure functions, no state.

The hub calls these before it changes anything, so a refused step or action leaves every session as it
was; the fuzz tests call them directly. Each raises RemoteProtocolError with the code the peer is told.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from broker.protocol.errors import ErrorCode, RemoteProtocolError
from broker.protocol.messages import GameStep, TrainerAct
from broker.protocol.spaces import DTYPES, GroupSpec, PolicySpaces, check_rows, rows_as_announced


def check_step(step: GameStep, groups: Mapping[str, GroupSpec], who: str) -> None:
    """``step`` carries exactly the announced ``groups``, each with one row per agent of its spaces."""
    if _as_announced(step, groups):
        return
    if set(step.groups) != set(groups):
        raise RemoteProtocolError(
            ErrorCode.BAD_STEP, f"{who}: step has groups {sorted(step.groups)}, hello announced {sorted(groups)}"
        )
    for name, data in step.groups.items():
        spec = groups[name]
        what = f"{who}, group '{name}'"
        if data.n_rows != spec.n_agents:
            raise RemoteProtocolError(ErrorCode.BAD_STEP, f"{what}: {data.n_rows} rows for {spec.n_agents} agents")
        check_rows(data.obs, spec.spaces.observation, spec.n_agents, f"{what} obs", ErrorCode.BAD_STEP)
        if data.final_obs is not None and data.final_index is not None:
            n_final = len(data.final_index)
            check_rows(data.final_obs, spec.spaces.observation, n_final, f"{what} final obs", ErrorCode.BAD_STEP)


def _as_announced(step: GameStep, groups: Mapping[str, GroupSpec]) -> bool:
    """The usual step, accepted in a C call per array map: exactly the announced groups, each with its agents'
    rows. False: not decided here (check_step's checks decide)."""
    if len(step.groups) != len(groups):
        return False
    for name, data in step.groups.items():
        spec = groups.get(name)
        if spec is None or len(data.reward) != spec.n_agents:
            return False
        layout = spec.spaces.observation_check
        if not rows_as_announced(data.obs, layout, spec.n_agents):
            return False
        final_obs, index = data.final_obs, data.final_index
        if final_obs is not None and index is not None and not rows_as_announced(final_obs, layout, len(index)):
            return False
    return True


def check_actions(act: TrainerAct, policy: str, spaces: PolicySpaces, n_envs: int) -> dict[str, np.ndarray]:
    """The actions of ``act`` in their canonical wire dtypes, once every key, shape and value is right."""
    if rows_as_announced(act.actions, spaces.action_check, n_envs):
        return act.actions  # in their wire dtypes already: canonical_actions would hand each back as it is
    known = dict(spaces.action)
    unknown = sorted(set(act.actions) - set(known))
    if unknown:
        raise RemoteProtocolError(ErrorCode.BAD_ACTIONS, f"unknown action keys {unknown}")
    actions = {k: canonical_actions(v, known[k].wire_dtype) for k, v in act.actions.items()}
    check_rows(actions, spaces.action, n_envs, f"policy '{policy}' actions", ErrorCode.BAD_ACTIONS)
    return actions


def canonical_actions(array: np.ndarray, wire_dtype: str) -> np.ndarray:
    """Accept any float for continuous and any integer for discrete actions; forward canonical dtypes."""
    target = DTYPES[wire_dtype]
    if array.dtype == target:
        return array
    if target.kind == "f" and array.dtype.kind == "f":
        with np.errstate(over="ignore"):  # a float64 beyond float32 becomes inf, which check_rows refuses
            return array.astype(target)
    if target.kind == "i" and array.dtype.kind in "iu":
        limits = np.iinfo(target)
        if array.size and (array.min() < limits.min or array.max() > limits.max):
            return array  # a cast would wrap (2**32 + 2 -> 2): check_rows judges the values as they came
        return array.astype(target)
    return array  # check_rows reports the wrong dtype
