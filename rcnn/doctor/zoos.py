"""The model zoos users bring, by name: timm's models and Hugging Face transformers', untrained, built on the
machine (nothing is downloaded), each with one synthetic batch and the loss of its kind.

- ``timm:<name>``: any ``timm.create_model`` name (``timm:vit_tiny_patch16_224``, ``timm:resnet10t``),
  ``pretrained=False``, fed images (B, 3, S, S) and cross-entropy on labels. A model whose class takes
  ``img_size`` (ViTs, Swin, MLP-Mixer: position embeddings or windows built for one size) is built for the
  ``--image-size`` given.
- ``hf:<model_type>``: a transformers model from its default config (``AutoConfig.for_model``), with the first
  head of ``HF_TASKS`` its type has, fed the batch that head trains on; its loss is the model's own (labels
  given): ``hf:vit`` and ``hf:convnext`` classify images of ``--image-size``; ``hf:bert`` fills masks and
  ``hf:gpt2`` predicts the next token on 128 tokens (fewer where its positions are fewer); ``hf:wav2vec2``
  transcribes 1 s of 16 kHz audio with CTC; ``hf:whisper`` transcribes log-mel features
  (``2 * max_source_positions`` frames) into 128 decoder tokens (fewer where its positions are fewer).

Options follow the name after ``?`` as Python keyword arguments, passed to ``timm.create_model`` or set on
the transformers config (only keys the config has; a bare word is a string). A default config is the full
model: shrink it for a small machine, e.g.
``hf:bert?num_hidden_layers=2,hidden_size=128,num_attention_heads=2,intermediate_size=256``,
``hf:whisper?max_source_positions=64,encoder_layers=1,decoder_layers=1,max_target_positions=32``,
``hf:wav2vec2?conv_dim=(64,64),conv_stride=(5,4),conv_kernel=(10,4),num_hidden_layers=2``, or
``timm:vit_base_patch16_224?depth=2``. Quote the spec in a shell. Options given to ``build_workload`` as
keywords join those of the spec.

timm and transformers are optional (``pip install 'roi-head-sweep[zoo]'``); without them a spec naming one
gets a one-line error with the pip command.
"""

from __future__ import annotations

import ast
import difflib
from typing import Any

import torch
from torch import nn

from rcnn.doctor.workloads import Loss, ModelError, classification_loss, synthetic_images
from rcnn.rules import first_line

TEXT_LENGTH = 128  # tokens of a text batch (a causal LM's, a decoder's labels), at most the model's positions
AUDIO_SAMPLES = 16_000  # one second at the 16 kHz wav2vec2 and whisper are built for
CTC_LABELS = 8  # characters to transcribe: fewer than the ~49 frames wav2vec2 makes of a second


def split_options(name: str, zoo: str) -> tuple[str, dict[str, Any]]:
    """``name?key=value,...`` as ``(name, {key: value})``: each value a Python literal (``2``, ``0.1``,
    ``(64, 64)``, ``'gelu'``) or a bare word, taken as a string."""
    base, sep, query = name.partition("?")
    if not sep:
        return name, {}
    try:
        call = ast.parse(f"options({query})", mode="eval").body
    except SyntaxError as err:
        raise ModelError(
            f"{zoo}:{name}: the options after '?' are not key=value,...; allowed: e.g. "
            f"{zoo}:{base}?num_hidden_layers=2,hidden_size=128 ({first_line(err)})"
        ) from err
    if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
        raise ModelError(f"{zoo}:{name}: the options after '?' must all be key=value; allowed: key=value,...")
    options = {}
    for keyword in call.keywords:
        value = keyword.value
        try:
            options[keyword.arg] = value.id if isinstance(value, ast.Name) else ast.literal_eval(value)
        except ValueError as err:
            raise ModelError(
                f"{zoo}:{name}: {keyword.arg}={ast.unparse(value)} is not a literal; allowed: numbers, "
                "strings, tuples, lists, True/False/None"
            ) from err
    return base, options


def _missing(zoo: str, package: str, err: ImportError) -> ModelError:
    return ModelError(
        f"{zoo}:<name> needs {package}, which does not import here ({first_line(err)}); allowed: "
        f"pip install {package} (or pip install 'roi-head-sweep[zoo]' for timm and transformers)"
    )


def _close(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    return f"; closest: {', '.join(close)}" if close else ""


def timm_workload(
    name: str, *, batch_size: int, image_size: int, device: torch.device, **options: Any
) -> tuple[nn.Module, Any, Loss]:
    """A timm model by name, untrained, with images and cross-entropy on labels (see the module's docstring).

    Args:
        name: a ``timm.create_model`` name, optionally with ``?key=value,...`` passed to it.
        batch_size: images in the batch.
        image_size: their square size in pixels; the model's ``img_size`` where its class takes one.
        device: where the batch goes.
        options: more keyword arguments for ``timm.create_model``.

    Returns:
        (model, images, loss).

    Raises:
        ModelError: timm is not installed, ``name`` is not a timm model, or timm refuses the options.
    """
    try:
        import timm
    except ImportError as err:
        raise _missing("timm", "timm", err) from err
    base, spec_options = split_options(name, "timm")
    if not timm.is_model(base):
        known = timm.list_models()
        raise ModelError(
            f"timm:{base} is not a timm model; allowed: one of the {len(known)} names timm.list_models() "
            f"gives{_close(base, known)}"
        )
    kwargs = {**spec_options, **options}
    try:
        try:  # a ViT's position embeddings are built for one size: that of the images it will see
            model = timm.create_model(base, pretrained=False, **{"img_size": image_size, **kwargs})
        except TypeError as err:
            if "img_size" in kwargs or "img_size" not in str(err):
                raise
            model = timm.create_model(base, pretrained=False, **kwargs)  # its class takes no img_size
    except Exception as err:
        raise ModelError(
            f"timm.create_model({base!r}, pretrained=False, ...) raised {first_line(err)}"
        ) from err
    return model, synthetic_images(batch_size, image_size, device), classification_loss


def _model_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A transformers model's own loss: it computes the loss of its head when given ``labels``."""
    return model(**batch).loss


def _tokens(config: Any, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch_size, length), generator=generator)


def _text_length(config: Any) -> int:
    return min(TEXT_LENGTH, getattr(config, "max_position_embeddings", None) or TEXT_LENGTH)


def _image_batch(config: Any, batch_size: int, image_size: int, generator: torch.Generator) -> dict:
    shape = (batch_size, getattr(config, "num_channels", 3), image_size, image_size)
    labels = torch.arange(batch_size) % config.num_labels
    return {"pixel_values": torch.rand(shape, generator=generator), "labels": labels}


def _text_batch(config: Any, batch_size: int, _image_size: int, generator: torch.Generator) -> dict:
    tokens = _tokens(config, batch_size, _text_length(config), generator)
    return {"input_ids": tokens, "labels": tokens}  # a causal LM shifts them; a masked LM predicts each


def _classified_text(config: Any, batch_size: int, _image_size: int, generator: torch.Generator) -> dict:
    tokens = _tokens(config, batch_size, _text_length(config), generator)
    return {"input_ids": tokens, "labels": torch.arange(batch_size) % config.num_labels}


def _ctc_batch(config: Any, batch_size: int, _image_size: int, generator: torch.Generator) -> dict:
    audio = torch.randn(batch_size, AUDIO_SAMPLES, generator=generator)
    # Characters other than padding, which is CTC's blank
    labels = torch.randint(1, config.vocab_size, (batch_size, CTC_LABELS), generator=generator)
    labels[labels == config.pad_token_id] = (config.pad_token_id + 1) % config.vocab_size
    return {"input_values": audio, "labels": labels}


def _speech_batch(config: Any, batch_size: int, _image_size: int, generator: torch.Generator) -> dict:
    # Whisper's encoder takes exactly 2 * max_source_positions frames (its second conv has stride 2)
    frames = 2 * config.max_source_positions
    features = torch.randn(batch_size, config.num_mel_bins, frames, generator=generator)
    length = min(TEXT_LENGTH, config.max_target_positions)
    return {"input_features": features, "labels": _tokens(config, batch_size, length, generator)}


# transformers' heads the doctor trains, in the order one is picked for a model type: (what it is called,
# the AutoModel class, the mapping of the model types that have it, the batch it trains on). Speech first:
# whisper has a causal-LM decoder, wav2vec2 a classification head; masked LM before causal LM: BERT has both.
HF_TASKS = [
    (
        "speech-seq2seq",
        "AutoModelForSpeechSeq2Seq",
        "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
        _speech_batch,
    ),
    ("ctc", "AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES", _ctc_batch),
    (
        "image-classification",
        "AutoModelForImageClassification",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
        _image_batch,
    ),
    ("masked-lm", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", _text_batch),
    ("causal-lm", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", _text_batch),
    ("seq2seq-lm", "AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", _text_batch),
    (
        "sequence-classification",
        "AutoModelForSequenceClassification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        _classified_text,
    ),
]


def _hf_config(model_type: str, overrides: dict[str, Any]) -> Any:
    """The default config of ``model_type`` with ``overrides``, each a key the config has (a config takes
    any key silently, so a typo would measure the full model)."""
    import transformers

    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        hint = (
            " (a model_type such as bert, not a Hub repo id: nothing is downloaded)"
            if "/" in model_type
            else ""
        )
        raise ModelError(
            f"hf:{model_type} is not a transformers model_type{hint}; allowed: one of the {len(known)} keys "
            f"of transformers.CONFIG_MAPPING{_close(model_type, known)}"
        )
    default = transformers.AutoConfig.for_model(model_type)
    unknown = sorted(key for key in overrides if not hasattr(default, key))
    if unknown:
        allowed = sorted(key for key in default.to_dict() if not key.startswith("_"))
        close = _close(unknown[0], allowed).removeprefix("; ")
        raise ModelError(
            f"hf:{model_type}: its config has no {', '.join(unknown)}{f' ({close})' if close else ''}; "
            f"allowed: {', '.join(allowed)}"
        )
    try:
        return transformers.AutoConfig.for_model(model_type, **overrides)
    except Exception as err:
        raise ModelError(f"hf:{model_type}'s config refuses the options ({first_line(err)})") from err


def hf_workload(
    name: str, *, batch_size: int, image_size: int, device: torch.device, **options: Any
) -> tuple[nn.Module, Any, Loss]:
    """A transformers model built from its default config, with the batch and loss of its head (see the
    module's docstring).

    Args:
        name: a transformers ``model_type`` (a key of ``transformers.CONFIG_MAPPING``: ``bert``, ``gpt2``,
            ``vit``, ...), optionally with ``?key=value,...`` set on its config.
        batch_size: examples in the batch.
        image_size: the square size of images, for image models (set as the config's ``image_size``).
        device: where the batch goes.
        options: more config keys and values.

    Returns:
        (model, batch, loss): the batch a dict of the model's keyword arguments, ``labels`` among them.

    Raises:
        ModelError: transformers is not installed, ``name`` is not a model type, the config has no such
            key, or the type has none of the heads of ``HF_TASKS``.
    """
    try:
        import transformers
        from transformers.models.auto import modeling_auto
    except ImportError as err:
        raise _missing("hf", "transformers", err) from err
    model_type, spec_options = split_options(name, "hf")
    overrides = {**spec_options, **options}
    task = next((t for t in HF_TASKS if model_type in getattr(modeling_auto, t[2], {})), None)
    config = _hf_config(model_type, overrides)
    if task is None:
        raise ModelError(
            f"hf:{model_type} has none of the heads the doctor trains; allowed: a model_type with a "
            f"{', '.join(t[0] for t in HF_TASKS)} head"
        )
    _, auto_class, _, make_batch = task
    if make_batch is _image_batch and "image_size" not in overrides and hasattr(config, "image_size"):
        config.image_size = image_size  # a ViT's position embeddings are built for one size
    try:
        model = getattr(transformers, auto_class).from_config(config)
    except Exception as err:
        raise ModelError(f"{auto_class}.from_config(hf:{name}) raised {first_line(err)}") from err
    generator = torch.Generator().manual_seed(0)
    batch = make_batch(config, batch_size, image_size, generator)
    return model, {key: value.to(device) for key, value in batch.items()}, _model_loss
