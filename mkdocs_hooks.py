"""mkdocs hooks: the Models section of the navigation comes from the registry
(`eqx_models.models.FAMILIES`), one page per family, `docs/models/<name>.md`."""

from eqx_models.models import families


def on_config(config):
    pages = ["models/index.md"] + [{arch.title: f"models/{name}.md"} for name, arch in families()]
    for entry in config["nav"]:
        if isinstance(entry, dict) and "Models" in entry:
            entry["Models"] = pages
            return config
    raise ValueError("mkdocs.yml has no 'Models' section in nav for the model pages to go in.")
