"""Framework integrations: a PyTorch Lightning callback (:mod:`.lightning`), a Hugging
Face ``transformers`` TrainerCallback (:mod:`.transformers`) and an ``accelerate`` helper
(:mod:`.accelerate`). Each module imports its framework only when it is imported itself,
so none of them is a dependency of steptrace (extras: ``steptrace[lightning]``,
``steptrace[transformers]``, ``steptrace[accelerate]``). See docs/integrations.md.
"""
