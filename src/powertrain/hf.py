"""Hugging Face ``Trainer``: gradient compression as a callback (``pip install 'powertrain[hf]'``).

    trainer = Trainer(model=model, args=args, train_dataset=data)
    compress_gradients(trainer, "powersgd")     # before trainer.train(); run under torchrun
    trainer.train()                             # later: trainer.train(resume_from_checkpoint=True)

When training begins (the Trainer has wrapped the model in ``DistributedDataParallel``), the callback builds the
compressor from the model's parameters and registers it on the DDP model (:func:`powertrain.ddp.register_compressor`).
Whenever the Trainer is about to save ``OUTPUT_DIR/checkpoint-N``, every worker writes its own compressor state
there first (``powertrain_compressor_rank<r>_of_<w>.bin``, :mod:`powertrain.serialize`'s format: loading runs no
code), next to the Trainer's per-rank RNG states; a run resumed at step N takes it back from ``OUTPUT_DIR``'s
``checkpoint-N``, and refuses to start without it (resume from a checkpoint in the run's own ``output_dir``; not
under ``hyperparameter_search``, whose trials save elsewhere). With ``accelerate`` in a hand-written loop,
``accelerator.prepare`` returns the DDP model: :func:`powertrain.ddp.register_compressor` applies as is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from powertrain import serialize
from powertrain._files import FileTooLarge, read_bounded, write_atomic
from powertrain.ddp import Rewrapped

__all__ = ["GradientCompression", "compress_gradients"]


def compress_gradients(trainer: Trainer, name: str = "powersgd", **options: Any) -> GradientCompression:
    """Replace ``trainer``'s DDP gradient all-reduce with the compressor ``name`` and its keyword ``options`` (see
    :func:`powertrain.compress.make_compressor`); returns the callback (its ``compressor`` exists once training
    began: ``.comm.stats`` counts what it sent)."""
    callback = GradientCompression(trainer, name, **options)
    trainer.add_callback(callback)
    return callback


class GradientCompression(TrainerCallback, Rewrapped):
    """See the module; added by :func:`compress_gradients`.

    Args:
        trainer: the Trainer whose DDP-wrapped model (``trainer.model_wrapped``) it registers on.
        name: the compressor, as :func:`powertrain.compress.make_compressor` takes it (default ``"powersgd"``).
        **options: the compressor's keyword options.
    """

    def __init__(self, trainer: Trainer, name: str = "powersgd", **options: Any) -> None:
        self.trainer = trainer
        Rewrapped.__init__(self, name, options)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Register on the Trainer's DDP wrapper (again on a new one, the compressor and its state kept). On a resume
        (``state.global_step > 0``) the first build loads this rank's state from
        ``checkpoint-<step>/powertrain_compressor_rank<r>_of_<world>.bin``; raises ValueError without a DDP model or
        for a state saved by another number of workers, FileNotFoundError where the file is missing."""
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, DistributedDataParallel):
            raise ValueError(
                f"compress_gradients needs the Trainer's model in DistributedDataParallel, got {type(ddp).__name__}: "
                "launch with torchrun --nproc-per-node N (compression replaces DDP's all-reduce)"
            )
        if self.registered_on(ddp):
            return
        # a later train() (or auto_find_batch_size's retry) wraps the model again: the same compressor, state kept
        compressor, fresh = self.register(ddp, ddp.module.named_parameters())
        if fresh and state.global_step > 0:  # resumed from OUTPUT_DIR/checkpoint-<step>
            path = self._path(args, state)
            if not path.exists() and not path.is_symlink():
                others = sorted(p.name for p in path.parent.glob("powertrain_compressor_rank0_of_*.bin"))
                if others:  # saved by another number of workers
                    saved = others[0].removesuffix(".bin").split("_of_")[-1][:20]
                    world = dist.get_world_size(compressor.comm.group)
                    raise ValueError(
                        f"Training resumed at step {state.global_step} with {world} workers, but {path.parent} holds "
                        f"the compressor state of {saved} workers: resume with that many (each worker's error "
                        "feedback is its own)"
                    )
                raise FileNotFoundError(
                    f"Training resumed at step {state.global_step} but {path} is missing: resume from a checkpoint "
                    "in this output_dir that was saved with compress_gradients (each worker's error feedback)"
                )
            # error buffers and the low-rank factors: within a few times the weights' bytes; checked before reading
            limit = 16 * sum(p.numel() * p.element_size() for p in ddp.module.parameters()) + (1 << 20)
            try:
                raw = read_bounded(path, limit, "The compressor state")
            except (FileTooLarge, OSError) as e:
                raise ValueError(f"Cannot resume the compressor at step {state.global_step}: {e}") from None
            compressor.load_state_dict(serialize.loads(raw))

    # Written when the Trainer decides to save, before it writes its own files and rotates old checkpoints: a crash
    # in between leaves a folder without trainer_state.json, which a resume does not pick.
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Where the Trainer saves at this step: writes this rank's compressor state into ``checkpoint-<step>``."""
        if control.should_save:
            self._save(args, state)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any) -> None:
        """Where the Trainer saves at the end of an epoch: writes this rank's compressor state, as
        :meth:`on_step_end` does."""
        if control.should_save:
            self._save(args, state)

    def _save(self, args: TrainingArguments, state: TrainerState) -> None:
        if self.compressor is None:
            return
        path = self._path(args, state)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, serialize.dumps(self.compressor.state_dict()))

    def _path(self, args: TrainingArguments, state: TrainerState) -> Path:
        group = self.compressor.comm.group if self.compressor is not None else None
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        name = f"powertrain_compressor_rank{rank}_of_{world}.bin"
        return Path(str(args.output_dir)) / f"checkpoint-{state.global_step}" / name
