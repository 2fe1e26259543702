"""The first module the CPU forkserver imports (`megarl.parallel.spawn.PRELOAD`): it installs
`quiet_cpu_warnings`' filters in the server, before the server imports megatron-core, so that neither the server nor
the ranks it forks print megatron's import-time notes. The forkserver is used only on machines without a GPU."""

from megarl.parallel.quiet_warnings import quiet_cpu_warnings

quiet_cpu_warnings()
