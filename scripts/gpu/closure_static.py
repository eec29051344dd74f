"""Static module-level import closure of a GPU run, read from the wheels themselves (no import).

closure_check.py imports the modules in the dev virtualenv, which cannot hold what only the
device can run (vLLM's CUDA 13 build pins torch 2.11; Python 3.12-only wheels). This reads the
carried wheels' source instead: starting from the given modules it follows every import that
runs when a module is imported (module level, class bodies, ``if`` branches, ``with`` blocks), not
the ones inside functions, under ``if TYPE_CHECKING``, or inside a ``try`` whose handler catches
the ImportError (those are listed as optional). Each imported top-level name must come from the
standard library, the device image (wheels/image.txt, names as the image's modules), a carried
wheel of the named sets, or the repository itself; anything else is reported with the import
chain that reaches it, and the exit status is 1.

  bash scripts/gpu/bundle.sh prepare .dev/b base te ray verl vllm          # fills .dev/b/pay/SET
  python scripts/gpu/closure_static.py --pay .dev/b/pay --sets base te ray verl vllm -- \\
      vllm vllm.entrypoints.llm vllm.v1.engine.core ...

A module found in the wheels but never reached is not checked; a module reached only through a
string (``importlib.import_module(name)``, vLLM's lazy model registry, Ray's ``qualname``) must
be given as a root. Roots may also be repository modules (testlab.x, scripts/gpu/x.py as a path).
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
import zipfile
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OWN_PACKAGES = {"r3bridge": os.path.join(REPO, "r3bridge"), "testlab": os.path.join(REPO, "testlab"),
                "adapters": os.path.join(REPO, "adapters"), "tests": os.path.join(REPO, "tests")}

# top-level module names of image distributions whose module is not the distribution's name
IMAGE_MODULE_NAMES = {
    "PIL": "pillow", "yaml": "pyyaml", "google": "protobuf", "cv2": "opencv-python-headless",
    "cpuinfo": "py-cpuinfo", "dateutil": "python-dateutil", "sklearn": "scikit-learn", "skimage": "scikit-image",
    "absl": "absl-py", "markdown_it": "markdown-it-py", "huggingface_hub": "huggingface-hub",
    "charset_normalizer": "charset-normalizer", "typing_extensions": "typing-extensions",
    "_cffi_backend": "cffi", "pynvml": "nvidia-ml-py", "cuda": "cuda-bindings", "nvidia": "nvidia-cublas",
    "hf_xet": "hf-xet", "pkg_resources": "setuptools", "_distutils_hack": "setuptools", "mpl_toolkits": "matplotlib",
    "lightning_utilities": "lightning-utilities", "opt_einsum": "opt-einsum", "torch_geometric": "torch-geometric",
    "tensorboard_data_server": "tensorboard-data-server", "jax_cuda13_plugin": "jax-cuda13-plugin",
    "multipart": "python-multipart", "dotenv": "python-dotenv", "jwt": "pyjwt", "zmq": "pyzmq",
    "pythonjsonlogger": "python-json-logger", "sse_starlette": "sse-starlette", "_yaml": "pyyaml",
    "pydantic_core": "pydantic-core", "pydantic_settings": "pydantic-settings", "rpds": "rpds-py",
    "jsonschema_specifications": "jsonschema-specifications", "annotated_types": "annotated-types",
    "typing_inspection": "typing-inspection", "annotated_doc": "annotated-doc", "importlib_metadata":
    "importlib-metadata", "prometheus_client": "prometheus-client", "email_validator": "email-validator",
    "partial_json_parser": "partial-json-parser", "openai_harmony": "openai-harmony", "attr": "attrs",
    "llguidance": "llguidance", "lmformatenforcer": "lm-format-enforcer", "outlines_core": "outlines-core",
    "mistral_common": "mistral-common", "compressed_tensors": "compressed-tensors", "flashinfer": "flashinfer-python",
    "tvm_ffi": "apache-tvm-ffi", "cutlass": "nvidia-cutlass-dsl", "cudnn": "nvidia-cudnn-frontend",
    "prometheus_fastapi_instrumentator": "prometheus-fastapi-instrumentator", "antlr4": "antlr4-python3-runtime",
    "opentelemetry": "opentelemetry-api", "sentencepiece": "sentencepiece", "websockets": "websockets",
    "model_hosting_container_standards": "model-hosting-container-standards", "quack": "quack-kernels",
    "deep_gemm": "deep-gemm", "triton_kernels": "triton-kernels", "grpc": "grpcio", "uvloop": "uvloop",
    "sglang": "sglang", "sgl_kernel": "sglang-kernel", "transfer_queue": "transferqueue",
}


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def set_distributions(name: str) -> set[str]:
    """Distribution names a wheel list (scripts/gpu/wheels/NAME.txt) holds."""
    out: set[str] = set()
    with open(os.path.join(HERE, "wheels", f"{name}.txt")) as f:
        for line in f:
            spec = line.split("#")[0].strip()
            if not spec:
                continue
            if spec.startswith("file:"):
                out.add(norm(os.path.basename(spec).split("-")[0]))
            else:
                out.add(norm(spec.removeprefix("build:").split("==")[0].split(">=")[0].split("[")[0]))
    return out


@dataclass
class Source:
    """Where a module's text is: a wheel member or a file of the repository."""
    dist: str
    zip_path: Optional[str] = None
    member: Optional[str] = None
    path: Optional[str] = None
    is_package: bool = False
    binary: bool = False

    def text(self) -> str:
        if self.path:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                return f.read()
        if self.zip_path not in _ZIPS:
            _ZIPS[self.zip_path] = zipfile.ZipFile(self.zip_path)   # type: ignore[index]
        return _ZIPS[self.zip_path].read(self.member).decode("utf-8", errors="replace")   # type: ignore[arg-type,index]


_ZIPS: dict[str, zipfile.ZipFile] = {}


@dataclass
class Index:
    modules: dict[str, Source] = field(default_factory=dict)
    top_dist: dict[str, str] = field(default_factory=dict)     # top-level name -> distribution (wheels)
    wheel_sizes: dict[str, int] = field(default_factory=dict)

    def add_wheel(self, path: str) -> None:
        dist = norm(os.path.basename(path).split("-")[0])
        self.wheel_sizes[dist] = os.path.getsize(path)
        with zipfile.ZipFile(path) as z:
            for member in z.namelist():
                parts = member.split("/")
                if ".dist-info" in parts[0] or ".data" in parts[0]:
                    continue
                name = parts[-1]
                if name.endswith(".py"):
                    mod = parts[:-1] + ([] if name == "__init__.py" else [name[:-3]])
                    src = Source(dist, zip_path=path, member=member, is_package=name == "__init__.py")
                elif name.endswith(".so") or name.endswith(".pyd"):
                    mod = parts[:-1] + [name.split(".")[0]]
                    src = Source(dist, zip_path=path, member=member, binary=True)
                else:
                    continue
                if not mod or not all(p.isidentifier() for p in mod):
                    continue
                dotted = ".".join(mod)
                if dotted not in self.modules or src.is_package:
                    self.modules[dotted] = src
                self.top_dist.setdefault(mod[0], dist)
                # namespace packages (no __init__.py): their folders are importable too
                for i in range(1, len(mod)):
                    self.modules.setdefault(".".join(mod[:i]), Source(dist, is_package=True))

    def add_repo(self) -> None:
        for top, root in OWN_PACKAGES.items():
            for dirpath, _dirs, files in os.walk(root):
                rel = os.path.relpath(dirpath, root)
                pkg = [top] + ([] if rel == "." else rel.split(os.sep))
                for fname in files:
                    if fname.endswith(".py"):
                        mod = pkg + ([] if fname == "__init__.py" else [fname[:-3]])
                        self.modules[".".join(mod)] = Source("(repository)", path=os.path.join(dirpath, fname),
                                                             is_package=fname == "__init__.py")
        # adapters/ is importable as r3bridge.adapters (pyproject's package-dir mapping)
        for name, src in list(self.modules.items()):
            if name == "adapters" or name.startswith("adapters."):
                self.modules["r3bridge." + name] = src


@dataclass
class Finding:
    module: str           # the imported name
    importer: str
    line: int
    optional: bool
    condition: str = ""     # the enclosing `if` tests ("" = unconditional)


class _Imports(ast.NodeVisitor):
    """The imports a module runs when it is imported: (name, level, fromlist, line, optional)."""

    def __init__(self, functions: bool = False) -> None:
        self.functions = functions       # also the imports inside function bodies
        self.found: list[tuple[str, int, list[str], int, bool, str]] = []
        self.guard = 0
        self.conditions: list[str] = []

    def visit_FunctionDef(self, node: ast.AST) -> None:     # bodies run later, if ever
        if self.functions:
            self.conditions.append("<in a function>")
            self.generic_visit(node)
            self.conditions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        if "TYPE_CHECKING" in test:
            for n in node.orelse:
                self.visit(n)
            return
        self.conditions.append(test)
        for n in node.body:
            self.visit(n)
        self.conditions[-1] = f"not ({test})"
        for n in node.orelse:
            self.visit(n)
        self.conditions.pop()

    def visit_Try(self, node: ast.Try) -> None:
        catches = False
        for h in node.handlers:
            names = ast.unparse(h.type) if h.type is not None else "BaseException"
            if any(w in names for w in ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")):
                catches = True
        self.guard += catches
        for n in node.body:
            self.visit(n)
        for n in node.handlers:     # the fallback runs only when the body failed
            self.visit(n)
        self.guard -= catches
        for n in node.orelse + node.finalbody:
            self.visit(n)

    visit_TryStar = visit_Try

    def visit_With(self, node: ast.With) -> None:
        # `with contextlib.suppress(ImportError):` guards its body like a try
        catches = any("suppress" in ast.unparse(i.context_expr) for i in node.items)
        self.guard += catches
        for n in node.body:
            self.visit(n)
        self.guard -= catches

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.found.append((a.name, 0, [], node.lineno, self.guard > 0, " and ".join(self.conditions)))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node.module or "", node.level, [a.name for a in node.names], node.lineno, self.guard > 0,
                           " and ".join(self.conditions)))


def _resolve(importer: str, is_package: bool, module: str, level: int) -> str:
    if level == 0:
        return module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


@dataclass
class Closure:
    reached: dict[str, tuple[str, int]] = field(default_factory=dict)    # module -> (importer, line)
    missing: dict[str, list[Finding]] = field(default_factory=dict)      # top-level -> findings (required)
    optional_missing: dict[str, list[Finding]] = field(default_factory=dict)
    conditional_missing: dict[str, list[Finding]] = field(default_factory=dict)   # under an `if`
    unresolved: list[Finding] = field(default_factory=list)              # name under a carried package, absent
    parse_errors: list[str] = field(default_factory=list)
    dists_used: set[str] = field(default_factory=set)
    conditions: dict[tuple[str, int], str] = field(default_factory=dict)   # (importer, line) -> its `if`

    def chain(self, module: str) -> list[str]:
        out, cur = [], module
        while cur in self.reached and len(out) < 40:
            imp, line = self.reached[cur]
            cond = self.conditions.get((imp, line))
            out.append(f"{cur}" + (f" <- {imp}:{line}" if imp else " (root)") + (f"  [if {cond[:100]}]" if cond else ""))
            if not imp or imp == cur:
                break
            cur = imp
        return out


def trace(index: Index, roots: Iterable[str], image: set[str], extra_ok: set[str] = frozenset(),
          *, conditional: bool = True, functions: Iterable[str] = ()) -> Closure:
    """``conditional=False``: follow only imports outside every ``if`` (what importing the roots
    certainly runs); True: also those under an ``if`` (reported apart: check their conditions)."""
    res = Closure()
    stdlib = set(sys.stdlib_module_names) | {"__future__", "__main__"}
    queue: deque[str] = deque()
    for r in roots:
        res.reached.setdefault(r, ("", 0))
        queue.append(r)

    def need(name: str, importer: str, line: int, optional: bool, cond: str) -> None:
        parts = name.split(".")
        top = parts[0]
        if top in stdlib or top in extra_ok:
            return
        if top not in index.top_dist and top not in {p.split(".")[0] for p in OWN_PACKAGES} and \
                index.modules.get(top) is None:
            dist = IMAGE_MODULE_NAMES.get(top, norm(top))
            if dist in image or norm(top) in image:
                return
            bucket = res.optional_missing if optional else res.conditional_missing if cond else res.missing
            bucket.setdefault(top, []).append(Finding(name, importer, line, optional, cond))
            return
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod not in index.modules:
                if not optional:
                    res.unresolved.append(Finding(mod, importer, line, optional, cond))
                return
            if mod not in res.reached:
                res.reached[mod] = (importer, line)
                queue.append(mod)

    for r in list(queue):
        if r not in index.modules:
            res.unresolved.append(Finding(r, "(root)", 0, False))
    while queue:
        mod = queue.popleft()
        src = index.modules.get(mod)
        if src is None or src.binary or (src.path is None and src.member is None):
            continue
        res.dists_used.add(src.dist)
        try:
            tree = ast.parse(src.text())
        except SyntaxError as e:
            res.parse_errors.append(f"{mod}: {e}")
            continue
        v = _Imports(functions=any(mod == f or mod.startswith(f + ".") for f in functions))
        v.visit(tree)
        for name, level, fromlist, line, optional, cond in v.found:
            target = _resolve(mod, src.is_package, name, level)
            if cond == "<in a function>" and functions:
                cond = ""      # a function the run calls (--functions): as good as module level
            if not target or (cond and not conditional):
                continue
            if cond:
                res.conditions.setdefault((mod, line), cond)
            need(target, mod, line, optional, cond)
            for item in fromlist:
                sub = f"{target}.{item}"
                if item != "*" and sub in index.modules and sub not in res.reached:
                    res.reached[sub] = (mod, line)
                    queue.append(sub)
    return res


def image_names() -> set[str]:
    return set_distributions("image")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pay", required=True, help="bundle.sh prepare's DIR/pay (one folder of wheels per set)")
    ap.add_argument("--sets", nargs="+", required=True)
    ap.add_argument("--optional", action="store_true", help="also list optional (guarded) imports the device lacks")
    ap.add_argument("--ok", nargs="*", default=[], help="top-level names to accept (stood in for by the run)")
    ap.add_argument("--functions", nargs="*", default=[],
                    help="module prefixes whose function-level imports the run executes too (followed as module level)")
    ap.add_argument("roots", nargs="+")
    args = ap.parse_args()
    index = Index()
    for s in args.sets:
        folder = os.path.join(args.pay, s)
        if not os.path.isdir(folder):
            print(f"no folder {folder}: run `bundle.sh prepare` with set {s} first")
            return 2
        for f in sorted(os.listdir(folder)):
            if f.endswith(".whl"):
                index.add_wheel(os.path.join(folder, f))
    index.add_repo()
    image = image_names()
    res = trace(index, args.roots, image, set(args.ok), conditional=False, functions=args.functions)
    full = trace(index, args.roots, image, set(args.ok), conditional=True, functions=args.functions)
    print(f"modules reached: {len(res.reached)}; distributions whose code was read: {len(res.dists_used)}")
    unused = sorted(set(index.wheel_sizes) - res.dists_used)
    if unused:
        mib = sum(index.wheel_sizes[d] for d in unused) / 2**20
        print(f"carried wheels never reached from these roots ({mib:.1f} MiB): {', '.join(unused)}")
    for e in res.parse_errors:
        print(f"parse error: {e}")
    for top, fs in sorted(res.missing.items()):
        f = fs[0]
        print(f"MISSING {top}: imported {len(fs)}x at module level, first {f.importer}:{f.line} ({f.module})")
        print("    " + "\n    ".join(res.chain(f.importer)[:12]))
    for top, fs in sorted(full.missing.items()):
        if top in res.missing:
            continue
        print(f"conditional, absent: {top}: reached only through an `if` (check that it is false on the device):")
        print("    " + "\n    ".join(full.chain(fs[0].importer)[:12]))
    for top, fs in sorted(full.conditional_missing.items()):
        if top in res.missing or top in full.missing:
            continue
        print(f"conditional, absent: {top}: imported under an `if` (check that it is false on the device):")
        for f in fs[:3]:
            print(f"    {f.importer}:{f.line} if {f.condition[:160]}")
    for f in res.unresolved:
        print(f"UNRESOLVED {f.module} (imported by {f.importer}:{f.line}): not in the carried wheel")
    if args.optional:
        for top, fs in sorted(res.optional_missing.items()):
            print(f"optional, absent: {top} ({fs[0].importer}:{fs[0].line})")
    return 1 if res.missing or res.unresolved else 0


if __name__ == "__main__":
    sys.exit(main())
