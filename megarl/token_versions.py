"""Which policy version produced each token of a response: the one record of versions, per token.

With in-flight weight updates (a push lands while requests are generating) one response can hold tokens of several
policy versions. `TokenVersions` is how a response says which: run-length segments `(version, tokens)` in token
order, read from the engine's own token counts at each pause (never from timing). The rollout side builds one per
response; `megarl.batch.RolloutBatch.token_versions` carries them to the trainer; the loss and the metrics read them
from there. Nothing else records a token's version.

A response generated inside one window (no push while it ran) is one segment: `TokenVersions.single(v, n)`.

A token's lag is the trainer's version when it consumes the token minus the version that sampled it (`version_lag`):
every lag the run computes, of a token, a response or a group's oldest token, is computed here; the bound it is held
to is the run's version clock's (`megarl.schedule.VersionClock.bound`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

Version = TypeVar("Version", int, "torch.Tensor")  # one version, or a tensor of them (a microbatch's, per token)


def version_lag(trainer_version: int, version: Version) -> Version:
    """How many versions a token sampled with `version` lags the trainer at `trainer_version` (negative: a version
    the trainer has not reached, which no consumed token may have); elementwise for a tensor of versions."""
    return trainer_version - version


@dataclass(frozen=True)
class TokenVersions:
    """Run-length record of the version of each response token: `runs = ((v0, n0), (v1, n1), ...)` means the
    first `n0` tokens were sampled with policy version `v0`, the next `n1` with `v1`, ... Versions never decrease
    along a response, every `n` is positive, and consecutive runs have different versions."""

    runs: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        for i, (version, tokens) in enumerate(self.runs):
            if tokens <= 0:
                raise ValueError(f"TokenVersions run {i} ({version}, {tokens}): a run holds at least one token")
            if i and version <= self.runs[i - 1][0]:
                raise ValueError(f"TokenVersions {self.runs}: versions must increase from one run to the next")

    @classmethod
    def single(cls, version: int, tokens: int) -> TokenVersions:
        """Every one of `tokens` tokens sampled with `version` (no runs when the response is empty)."""
        return cls(((version, tokens),) if tokens > 0 else ())

    def extended(self, version: int, tokens: int) -> TokenVersions:
        """This record followed by `tokens` more tokens sampled with `version` (merged into the last run when it
        is the same version)."""
        if tokens == 0:
            return self
        if self.runs and self.runs[-1][0] == version:
            return TokenVersions((*self.runs[:-1], (version, self.runs[-1][1] + tokens)))
        return TokenVersions((*self.runs, (version, tokens)))

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def oldest(self) -> int:
        """The version of the first token (the oldest: versions never decrease)."""
        if not self.runs:
            raise ValueError("an empty response has no token versions")
        return self.runs[0][0]

    @property
    def newest(self) -> int:
        if not self.runs:
            raise ValueError("an empty response has no token versions")
        return self.runs[-1][0]

    @property
    def spans_versions(self) -> bool:
        """Whether a push landed while this response was generating (its tokens come from two or more versions)."""
        return len(self.runs) > 1

    def lags(self, trainer_version: int) -> tuple[tuple[int, int], ...]:
        """`(lag, tokens)` of each run at `trainer_version` (`version_lag`), oldest run first."""
        return tuple((version_lag(trainer_version, version), tokens) for version, tokens in self.runs)

    def oldest_lag(self, trainer_version: int) -> int:
        """The lag of the first (oldest) token at `trainer_version`: the response's largest."""
        return version_lag(trainer_version, self.oldest)

    def newest_lag(self, trainer_version: int) -> int:
        """The lag of the last (newest) token at `trainer_version`: the response's smallest."""
        return version_lag(trainer_version, self.newest)

    def per_token(self) -> list[int]:
        """One version per token, in token order."""
        return [version for version, tokens in self.runs for _ in range(tokens)]
