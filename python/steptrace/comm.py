"""Host timing of collectives: a DDP communication hook that times each bucket's
all-reduce from launch to completion through the core's lock-free collective timer."""

from typing import Any, Callable, Optional


def timed_comm_hook(core: Any, hook: Optional[Callable[[Any, Any], Any]] = None) -> Callable[[Any, Any], Any]:
    """``hook`` (default: DDP's own all-reduce) wrapped so that the core sees when each
    bucket's collective was launched and when it completed (on the backend's thread)."""
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        hook = allreduce_hook
    begin, end = core.collective_begin, core.collective_end

    # No annotations: DDP rejects a hook whose annotations are not GradBucket / Future.
    def timed(state, bucket):  # type: ignore[no-untyped-def]
        token = begin()
        try:
            fut = hook(state, bucket)
        except BaseException:
            end(token)
            raise

        def done(f: Any) -> Any:
            try:
                return f.value()
            finally:
                end(token)

        return fut.then(done)

    return timed
