"""``r3bridge new-adapter NAME [--dir PATH]``: write a new adapter package from the template.

The package lives wherever ``PATH`` is (default ``./r3bridge-NAME``), outside r3bridge's tree:

    PATH/pyproject.toml                    distribution r3bridge-NAME, entry point r3bridge.adapters
    PATH/README.md
    PATH/NAME/{__init__,config,rollout,codec,hooks}.py      from r3bridge.adapters._template
    PATH/tests/test_NAME_conformance.py    conformance checks 1-5 with pytest

The template's files import each other relatively; the copy renames the template's classes
(``TemplateCodec`` -> ``<Name>Codec``, ...) and its absolute package name. It runs as it is (on
the template's toy framework) until the parts marked "your framework" are replaced.
"""
from __future__ import annotations

import argparse
import keyword
import re
import string
from importlib import resources
from pathlib import Path
from typing import Optional

from r3bridge import __version__
from r3bridge.cli._common import CliError

NAME = "new-adapter"
TEMPLATE_PACKAGE = "r3bridge.adapters._template"
PACKAGE_FILES = ("__init__.py", "config.py", "rollout.py", "codec.py", "hooks.py")
TEST_FILE = "conformance_tests.py"   # shipped under a non-test name; written as tests/test_<name>_conformance.py
SCAFFOLD = {"pyproject.toml": "scaffold/pyproject.toml.in", "README.md": "scaffold/README.md.in"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        NAME, help="write a new adapter package (template, pyproject, conformance tests)",
        description="Write an adapter package for a framework r3bridge does not ship: the template's "
                    "config / rollout / codec / hooks modules, a pyproject announcing it in the "
                    "'r3bridge.adapters' entry-point group, a pytest module running conformance "
                    "checks 1-5, and a README. Nothing existing is overwritten.")
    p.add_argument("name", metavar="NAME", help="the adapter's package name (a Python identifier, e.g. myfw)")
    p.add_argument("--dir", metavar="PATH", help="where to write the project (default ./r3bridge-NAME); "
                                                  "must not exist or be empty")
    return p


def camel_case(name: str) -> str:
    """``my_fw`` -> ``MyFw`` (the prefix of the adapter's class names)."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def _check_name(name: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
        raise CliError(f"adapter name {name!r} must be a Python identifier not starting with '_' "
                       f"(it names the package)")
    if name != name.lower():
        raise CliError(f"adapter name {name!r} must be lower case (a package name)")
    if name in ("r3bridge", "tests", "test") or name.startswith("r3bridge"):
        raise CliError(f"adapter name {name!r} would shadow r3bridge or the tests package")


def render_module(text: str, package: str) -> str:
    """A template module's text for the adapter package ``package``."""
    camel = camel_case(package)
    text = text.replace(TEMPLATE_PACKAGE, package)
    text = re.sub(r"\bTestTemplate", f"Test{camel}", text)
    text = re.sub(r"\bTemplate(?=[A-Z])", camel, text)
    text = text.replace('"""Template: r3bridge for <YourFramework>,', f'"""r3bridge for {package},')
    text = text.replace('framework="template"', f'framework="{package}"')     # the name route traces record
    return text.replace("<YourFramework>", package)


def render_files(package: str) -> dict[str, str]:
    """Relative path -> text of every file of the new project."""
    _check_name(package)
    template = resources.files(TEMPLATE_PACKAGE)
    files = {f"{package}/{name}": render_module(template.joinpath(name).read_text(encoding="utf-8"), package)
             for name in PACKAGE_FILES}
    files[f"tests/test_{package}_conformance.py"] = render_module(
        template.joinpath(TEST_FILE).read_text(encoding="utf-8"), package)
    fields = dict(name=package, package=package, dist_name=package.replace("_", "-"), camel=camel_case(package),
                  r3bridge_version=__version__)
    for target, source in SCAFFOLD.items():
        files[target] = string.Template(template.joinpath(source).read_text(encoding="utf-8")).substitute(fields)
    return files


def write_adapter(package: str, directory: Optional[str] = None) -> tuple[Path, list[str]]:
    """Write the project of adapter ``package`` into ``directory``; returns (root, files written).
    Refuses a directory that holds anything (never overwrites)."""
    files = render_files(package)
    root = Path(directory if directory is not None else f"r3bridge-{package.replace('_', '-')}")
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise CliError(f"{root}: exists and is not an empty directory (new-adapter never overwrites)")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root, sorted(files)


def run(args) -> int:
    root, written = write_adapter(args.name, args.dir)
    print(f"wrote adapter {args.name!r} in {root}/:")
    for rel in written:
        print(f"  {rel}")
    print(f"next: replace the parts marked \"your framework\" (docs/porting.md), then\n"
          f"  cd {root} && python -m pytest          # conformance checks 1-5")
    return 0
