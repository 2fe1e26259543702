"""`SyncSchedule` lives in `megarl.schedule` with the run's version clock; this name stays for the tests that import
it from here."""

from megarl.schedule import SyncSchedule

__all__ = ["SyncSchedule"]
