"""What the trainer accepts of responses whose tokens come from several policy versions (in-flight weight updates,
`megarl.token_versions`): the staleness bound and the algorithms that need one sampling policy per group.

A token's lag is `trainer version - the version that sampled it` (the trainer's version when it consumes the batch,
before its update). The bound (`algorithm.max_token_lag`; None: the schedule's own maximum lag `m + n - 1`, with
`m, n = sync.interval, sync.offset`; the run's `megarl.schedule.VersionClock.bound`) is enforced upstream: the
rollout side drops, and counts, a group whose oldest token would exceed it. The trainer only checks that none
arrives (`check_token_versions` raises: a batch past the bound is a bug upstream, never trained). An algorithm in
`catalog.SINGLE_VERSION_GROUPS` (OAPL) refuses a batch in which a group holds tokens of more than one version, with
the reason.
"""

from __future__ import annotations

from megarl.algorithms.catalog import SINGLE_VERSION_GROUPS
from megarl.token_versions import TokenVersions


def stale_samples(token_versions: list[TokenVersions], trainer_version: int,
                  bound: int) -> list[tuple[int, int, int]]:
    """`(sample index, lag of its oldest token, lag of its newest)` of every sample whose oldest token lags the
    trainer by more than `bound`, or whose newest token is newer than the trainer (a negative lag: no such version
    has been trained yet)."""
    return [(i, tv.oldest_lag(trainer_version), tv.newest_lag(trainer_version)) for i, tv in enumerate(token_versions)
            if tv.runs and (tv.oldest_lag(trainer_version) > bound or tv.newest_lag(trainer_version) < 0)]


def mixed_version_groups(token_versions: list[TokenVersions], group_size: int) -> list[int]:
    """Indices of the groups (`group_size` consecutive samples) whose tokens come from more than one version."""
    if len(token_versions) % group_size:
        raise ValueError(f"{len(token_versions)} samples do not form groups of {group_size}")
    return [g for g in range(len(token_versions) // group_size)
            if len({v for tv in token_versions[g * group_size:(g + 1) * group_size] for v, _ in tv.runs}) > 1]


def check_token_versions(token_versions: list[TokenVersions] | None, group_size: int, trainer_version: int,
                         bound: int, algorithm_name: str) -> None:
    """Raise when the batch holds a token past the staleness bound, or a mixed-version group for an algorithm in
    `catalog.SINGLE_VERSION_GROUPS`; nothing to check without per-token versions (every token of the batch's
    `policy_version`)."""
    if token_versions is None:
        return
    stale = stale_samples(token_versions, trainer_version, bound)
    if stale:
        raise RuntimeError(
            f"batch holds {len(stale)} samples with tokens outside the staleness bound (trainer version "
            f"{trainer_version}, bound {bound} versions; (sample, oldest lag, newest lag): {stale[:8]}): the rollout "
            "side must drop and count such groups before they reach the trainer; raise algorithm.max_token_lag to "
            "train on them"
        )
    if algorithm_name in SINGLE_VERSION_GROUPS:
        mixed = mixed_version_groups(token_versions, group_size)
        if mixed:
            raise ValueError(
                f"algorithm.name={algorithm_name!r} refuses groups whose tokens come from several policy versions "
                f"(groups {mixed[:8]} of this batch): {SINGLE_VERSION_GROUPS[algorithm_name]}. Turn in-flight "
                "weight updates off for it (a push then waits for the groups in flight), or choose an algorithm that "
                "takes mixed-version data (docs/algorithms.md, 'Mixed-version responses')"
            )
