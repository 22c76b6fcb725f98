"""Provider names usable in config, resolved lazily so a worker imports only its own provider.

A config may also name any installed class as "package.module:ClassName"; that imports code
from the environment the operator installed, never from the data root.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from queue_client.errors import ConfigError
from queue_providers.base import DataProviderBase, ProviderContext

BUILTIN: dict[str, str] = {
    "bert_mlm": "queue_providers.bert_mlm:BertMLMProvider",
    "char_diffusion": "queue_providers.char_diffusion:CharDiffusionProvider",
    "char_lm": "queue_providers.char_lm:CharLMProvider",
    "classification": "queue_providers.classification:ClassificationProvider",
    "mixture": "queue_providers.mixture:MixtureProvider",
    "nanogpt_bin": "queue_providers.nanogpt_bin:NanoGPTBinProvider",
    "text_lm": "queue_providers.text_lm:TextLMProvider",
    "token_classification": "queue_providers.token_classification:TokenClassificationProvider",
    "token_shards": "queue_providers.token_shards:TokenShardsProvider",
}


def resolve(name: str) -> type[DataProviderBase]:
    """The provider class for a config `provider = ...` value."""
    target = BUILTIN.get(name, name)
    module_name, sep, class_name = target.partition(":")
    if not sep:
        raise ConfigError(
            f"provider {name!r} is unknown: use one of {sorted(BUILTIN)} or 'package.module:ClassName'"
        )
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"provider {name!r} cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, DataProviderBase)):
        raise ConfigError(f"provider {name!r} is not a DataProviderBase subclass")
    return cls


def check_args(cls: type[DataProviderBase], args: dict[str, Any], where: str) -> None:
    """Fail at config load, naming the key, when args don't fit the provider's signature."""
    params = inspect.signature(cls.__init__).parameters
    accepted = {n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(set(args) - accepted)
    if unknown and not takes_any:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown} for provider {cls.__name__}; accepted: {sorted(accepted)}"
        )
    missing = sorted(
        n
        for n, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        and p.default is inspect.Parameter.empty
        and n not in args
    )
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing} for provider {cls.__name__}")


def create(name: str, context: ProviderContext, args: dict[str, Any]) -> DataProviderBase:
    cls = resolve(name)
    check_args(cls, args, f"datasets.{context.dataset_name}.args")
    provider = cls(context, **args)
    provider.config_args = dict(args)  # for data_identity(): what the data caches depend on
    return provider
