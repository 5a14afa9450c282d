"""The live side: what runs inside the training process beside the compiled core: the
:class:`~steptrace.live.profiler.Profiler` and its configuration, the hooks (CUDA, process,
torch.profiler, automatic phases, intervals between steps, CUDA graph capture, compiles),
the collectives' timing, useful work, the record channel from the core, the flight
recorder, the OTLP export and ``steptrace run``'s launcher.

Nothing is imported here: ``steptrace.Profiler`` loads the core on first use.
"""
