"""`--help` of the commands whose flags are settings (`kvpool store`, `kvpool master`).

Their options default to None so that a flag left unset does not override the TOML file or a `KVPOOL_*`
variable (`kvpool.config.load_config`). Their help shows the settings class's built-in default instead,
read when the help is printed: `kvpool --help` imports no settings class (nor grpc through it).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import typer.core


def settings_command(
    settings: str, renamed: Mapping[str, str] | None = None
) -> type[typer.core.TyperCommand]:
    """A command class (`app.command(cls=...)`) whose help shows each None-default option's built-in default:
    the default of the field of the same name (or `renamed[option]`) of `settings` ("module:Class")."""
    fields_of = dict(renamed or {})

    class SettingsCommand(typer.core.TyperCommand):
        def format_help(self, ctx: Any, formatter: Any) -> None:
            module, _, name = settings.partition(":")
            fields = getattr(importlib.import_module(module), name).model_fields
            shown: list[tuple[typer.core.TyperOption, Any, Any]] = []
            for param in self.params:
                field = fields.get(fields_of.get(param.name or "", param.name or ""))
                if (
                    not isinstance(param, typer.core.TyperOption)
                    or param.default is not None
                    or field is None
                ):
                    continue
                default = field.get_default(call_default_factory=True)
                if default is None or default == "":  # e.g. no master: the option's help says what then
                    continue
                shown.append((param, param.default, param.show_default))
                param.default, param.show_default = default, True
            try:
                super().format_help(ctx, formatter)
            finally:  # the defaults are for the help only: an unset flag stays None (TOML/env still apply)
                for param, default, show in shown:
                    param.default, param.show_default = default, show

    return SettingsCommand
