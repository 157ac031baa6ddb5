"""THE table of classes a DeepSpeed checkpoint may make the unpickler build (besides torch's weights-only set).

Found by saving real checkpoints (DeepSpeed 0.19, 1 rank, tiny GPT-2) for ZeRO 0/1/2/3 x fp32/bf16/fp16
(dynamic and static loss scale) and their universal conversions, and listing every global the pickles name
(``torch.serialization.get_unsafe_globals_in_checkpoint``); ``tests/security/test_storage.py`` loads such
checkpoints through it. Which file holds what:

======================================================  ==========================================================
class                                                   where
======================================================  ==========================================================
deepspeed.runtime.zero.config.ZeroStageEnum             ``*_optim_states.pt`` (``zero_stage``), ZeRO 1/2/3; universal
deepspeed.runtime.fp16.loss_scaler.LossScaler           ``*_optim_states.pt`` (``loss_scaler``): fp32, bf16, static fp16
deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler    ``*_optim_states.pt`` (``loss_scaler``): dynamic fp16
deepspeed.utils.tensor_fragment.fragment_address        ``*_optim_states.pt`` (``param_slice_mappings``), ZeRO 1/2
numpy ndarray / dtype / _reconstruct / UInt32DType      ``*_model_states.pt``: the client state's RNG states
                                                        (``np.random.get_state()``): ``safe_load.NUMPY_RNG``
                                                        (``_reconstruct`` under its numpy 1 and 2 names)
======================================================  ==========================================================

Everything else DeepSpeed saves (tensors, ``torch.Size``, ``OrderedDict``, dicts/lists of numbers and strings,
the config dict) is in torch's own weights-only set. A checkpoint naming any other class is refused
(:class:`~deadpool_ext.persist.safe_load.UntrustedCheckpointError`); a job whose client state holds other
objects passes them as ``extra=`` (each one a decision that the class is safe to construct from a file).
"""
from __future__ import annotations

from collections.abc import Iterable

from ...persist.safe_load import NUMPY_RNG, SafeGlobal


def deepspeed_globals(extra: Iterable[SafeGlobal] = ()) -> list[SafeGlobal]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, *NUMPY_RNG, *extra]
