"""`--yaml-cfg FILE`: the arguments of a run from a YAML file in upstream Megatron-LM's layout.

The file has a `language_model:` section (TransformerConfig field names), a `model_parallel:` section
(ModelParallelConfig field names) and top-level keys named after the argparse destinations (`micro_batch_size`,
`lr`, `data_path`, ...). `null` means "unset: the default"; `${VAR}` in a string is the environment variable VAR.

The file becomes command-line words for the same parser, so types, choices, nargs and every validation apply
as to flags; the real command line follows those words, so a flag given with --yaml-cfg overrides the file's
value (upstream ignores such flags) and rank 0 prints which keys were overridden. Field names that are not
argparse destinations go through the table of `megatron.training.yaml_config_keys`.
"""

import argparse
import difflib
import os
import re

import yaml

from megatron.training.yaml_config_keys import KNOWN_KEYS, UnsupportedValue, settings_of_key

YAML_CFG_FLAG = "--yaml-cfg"
CONFIG_SECTIONS = ("language_model", "model_parallel")
_ENVIRONMENT_VARIABLE = re.compile(r"\$\{([^}]*)\}")
_TRUE_WORDS, _FALSE_WORDS = ("true", "yes", "1"), ("false", "no", "0")


class YamlConfigError(ValueError):
    """What is wrong with a --yaml-cfg file: one message for every offending key."""


def add_arguments(parser):
    parser.add_argument(YAML_CFG_FLAG, default=None, metavar="FILE",
                        help="All arguments from a YAML file in upstream Megatron-LM's layout (language_model: and "
                        "model_parallel: sections, top-level argparse names; null: the default; ${VAR}: an "
                        "environment variable). Flags given with it override the file's values. Example: "
                        "examples/gpt3/gpt_config.yaml.")


def yaml_cfg_path(argv):
    """The file of the last --yaml-cfg in `argv` (either spelling, `--yaml-cfg F` or `--yaml-cfg=F`), or None."""
    path = None
    for index, word in enumerate(argv):
        if word == YAML_CFG_FLAG and index + 1 < len(argv):
            path = argv[index + 1]
        elif word.startswith(YAML_CFG_FLAG + "="):
            path = word.split("=", 1)[1]
    return path


def with_yaml_arguments(parser, argv):
    """`argv` with the words its --yaml-cfg file stands for in front (so the command line wins), `argv` itself
    without --yaml-cfg. A faulty file is a parser error (exit 2) naming the file and every offending key."""
    path = yaml_cfg_path(argv)
    if path is None:
        return argv
    try:
        settings, problems = config_settings(load_config(path), parser)
        words, value_problems = words_of_settings(parser, settings)
    except YamlConfigError as error:
        problems, value_problems = [str(error)], []
    if problems or value_problems:
        parser.error(f"{YAML_CFG_FLAG} {path}:\n  " + "\n  ".join(problems + value_problems))
    overridden = overridden_keys(parser, settings, argv)
    if overridden and int(os.environ.get("RANK", "0")) == 0:
        print(f"{YAML_CFG_FLAG} {path}: the command line overrides {', '.join(overridden)}", flush=True)
    return words + list(argv)


def load_config(path):
    """The file's mapping, with `${VAR}` replaced by the environment's values."""
    try:
        with open(path, encoding="utf-8") as stream:
            config = yaml.safe_load(stream)
    except OSError as error:
        raise YamlConfigError(f"cannot read it ({error.strerror})") from error
    except yaml.YAMLError as error:
        raise YamlConfigError(f"not valid YAML: {error}") from error
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise YamlConfigError(f"the file must hold a mapping of keys to values, not a {type(config).__name__}")
    unset = []
    config = _substitute_environment(config, "", unset)
    if unset:
        raise YamlConfigError("environment variables that are not set: " + ", ".join(
            f"{variable} (in {key})" for key, variable in unset) + "; set them or write the values")
    return config


def _substitute_environment(value, key, unset):
    if isinstance(value, dict):
        return {name: _substitute_environment(item, _key_path(key, name), unset) for name, item in value.items()}
    if isinstance(value, list):
        return [_substitute_environment(item, key, unset) for item in value]
    if not isinstance(value, str):
        return value

    def environment_value(match):
        variable = match.group(1)
        if variable not in os.environ:
            unset.append((key, variable))
            return match.group(0)
        return os.environ[variable]

    return _ENVIRONMENT_VARIABLE.sub(environment_value, value)


def _key_path(section, key):
    return f"{section}.{key}" if section else str(key)


def config_settings(config, parser):
    """([(key path, destination, value)] of every key that sets something (null keys and accepted no-ops set
    nothing), the problems: one naming every unknown key (with the closest known one), then one per value no flag
    gives and per pair of keys that disagree on a destination)."""
    destinations = _destinations(parser)
    settings, unknown, problems = [], [], []
    for section, items in _sections(config):
        for key, value in items.items():
            if value is None:  # unset: the default, whatever the key
                continue
            path = _key_path(section, key)
            try:
                key_settings = settings_of_key(key, value, items, in_config_section=bool(section))
            except UnsupportedValue as error:
                problems.append(f"{path}: {error}")
                continue
            if key_settings is None and key in destinations:
                key_settings = [(key, value)]
            if key_settings is None:
                unknown.append(_unknown_key(section, key, destinations))
                continue
            settings.extend((path, destination, setting) for destination, setting in key_settings)
    settings, disagreements = _without_disagreements(settings, parser)
    problems.extend(disagreements)
    if unknown:
        problems.insert(0, "keys this build does not take: " + ", ".join(unknown) + " (drop them, or set them to "
                        "null; the keys are argparse names at the top level and TransformerConfig / "
                        "ModelParallelConfig field names in language_model: / model_parallel:)")
    return settings, problems


def _destinations(parser):
    return {action.dest for action in parser._actions
            if action.option_strings and action.dest not in ("help", "yaml_cfg")}


def _sections(config):
    """(section name, mapping) for the top level ("") and each config section."""
    top_level = {key: value for key, value in config.items() if key not in CONFIG_SECTIONS}
    sections = [("", top_level)]
    for section in CONFIG_SECTIONS:
        items = config.get(section)
        if items is None:
            continue
        if not isinstance(items, dict):
            raise YamlConfigError(f"{section} must be a mapping of field names to values, not {items!r}")
        sections.append((section, items))
    return sections


def _unknown_key(section, key, destinations):
    candidates = sorted(destinations | set(KNOWN_KEYS) | ({*CONFIG_SECTIONS} if not section else set()))
    close = difflib.get_close_matches(str(key), candidates, n=1, cutoff=0.75)
    path = _key_path(section, key)
    return f"{path} (did you mean {_key_path(section, close[0])}?)" if close else path


def _without_disagreements(settings, parser):
    """(`settings` less the top-level keys at their defaults that a config field sets otherwise, one problem for
    each pair of keys that still set a destination differently). Upstream builds the model from the config
    sections, and its files list every top-level key: `group_query_attention: false` beside
    `language_model.num_query_groups: 8`, or `swiglu: false` beside `activation_func: swiglu`, is no conflict."""
    in_sections = {destination for path, destination, _ in settings if "." in path}
    kept = [(path, destination, value) for path, destination, value in settings
            if "." in path or destination not in in_sections or value != parser.get_default(destination)]
    first, problems = {}, []
    for path, destination, value in kept:
        if destination in first and first[destination][1] != value:
            other_path, other_value = first[destination]
            problems.append(f"{other_path} and {path} disagree: they set {destination} to {other_value!r} and "
                            f"{value!r}")
        first.setdefault(destination, (path, value))
    return kept, problems


def words_of_settings(parser, settings):
    """(the command-line words of `settings`, argparse's message for each value of the wrong type, naming its
    key)."""
    actions = {}
    for action in parser._actions:
        if action.option_strings:
            actions.setdefault(action.dest, []).append(action)
    words, problems = [], []
    for path, destination, value in settings:
        try:
            words.extend(_words_of(parser, actions[destination], value))
        except (argparse.ArgumentError, UnsupportedValue) as error:
            problems.append(f"{path}: {error}")
    return words, problems


def _words_of(parser, actions, value):
    if value is None:
        return []
    switches = [action for action in actions if action.nargs == 0]
    valued = [action for action in actions if action.nargs != 0]
    if switches and (isinstance(value, bool) or not valued):
        return _switch_words(parser, switches, _boolean(value, switches[0]))
    action = valued[0]
    if isinstance(value, dict):
        raise UnsupportedValue(f"{_option(action)} takes a value or a list, not a mapping")
    if isinstance(value, list) and action.nargs in (None, "?"):
        raise UnsupportedValue(f"{_option(action)} takes one value, not a list")
    texts = [_text(item) for item in (value if isinstance(value, list) else [value])]
    if not texts and action.nargs == "+":
        raise UnsupportedValue(f"{_option(action)} needs at least one value")
    parsed = parser._get_values(action, texts if action.nargs is not None else texts[:1])  # types and choices
    if type(action) is argparse._StoreAction and _is_default(parsed, parser.get_default(action.dest)):
        # Upstream's files list every key: one at its default is left out, as a flag would be (a list of one
        # value would not equal a scalar default that rules compare against). Actions of this build's own
        # classes record that they were given, so they always get their words.
        return []
    if action.nargs is None:
        return [f"{_option(action)}={texts[0]}"]
    return [_option(action), *texts]


def _switch_words(parser, switches, value):
    """The switch that stores `value`; none for the default (except for this build's own actions, which may record
    that they were given)."""
    default = parser.get_default(switches[0].dest)
    if default == value and all(type(action).__module__ == "argparse" for action in switches):
        return []
    for action in switches:
        if isinstance(action, argparse.BooleanOptionalAction):
            return [action.option_strings[0] if value else action.option_strings[1]]
        if (True if action.const is None else action.const) == value:
            return [_option(action)]
    if default == value:
        return []
    raise UnsupportedValue(f"no flag sets {switches[0].dest} to {str(value).lower()} "
                           f"({' / '.join(_option(action) for action in switches)})")


def _is_default(parsed, default):
    return parsed == default or (isinstance(parsed, list) and len(parsed) == 1 and parsed[0] == default)


def _boolean(value, action):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE_WORDS + _FALSE_WORDS:  # e.g. from ${VAR}
        return value.lower() in _TRUE_WORDS
    raise UnsupportedValue(f"{_option(action)} is a switch: the value must be true or false, got {value!r}")


def _option(action):
    long_options = [option for option in action.option_strings if option.startswith("--")]
    return (long_options or action.option_strings)[0]


def _text(value):
    return str(value).lower() if isinstance(value, bool) else str(value)


def overridden_keys(parser, settings, argv):
    """'key (--flag)' for each key of the file whose destination a flag of `argv` also sets."""
    given = {}
    for word in argv:
        action = parser._option_string_actions.get(word.split("=", 1)[0]) if word.startswith("-") else None
        if action is not None and action.dest != "yaml_cfg":
            given.setdefault(action.dest, word.split("=", 1)[0])
    return [f"{path} ({given[destination]})" for path, destination, _ in settings if destination in given]
