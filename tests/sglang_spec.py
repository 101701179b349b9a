"""SGLang's HTTP contract, read from the pinned wheel's own source with ``ast`` (sglang is never imported).

:func:`fetch_wheel` downloads ``sglang==SGLANG_VERSION`` once into ``~/.cache/agentrl/sglang-wheels/``
(``pip download --no-deps``, a fixed wheel tag so that every host gets the same file) and
:func:`load_spec` parses, from the zip:

* ``entrypoints/http_server.py``: the route table -- path -> methods, handler, the request struct of
  the handler's annotation (``obj: Annotated[X, Body()]`` or ``obj: X``), the ``@auth_level``;
* ``managers/io_struct.py``: every request struct's fields (annotation, required or default),
  base classes included (``BaseReq``'s ``rid``);
* ``api/v1/api_types.py``: the ``/generate`` contract's ``SamplingParams`` (the gate that rejects
  unknown ``sampling_params`` keys);
* ``entrypoints/openai/protocol.py``: the pydantic models of the OpenAI-compatible routes
  (``ChatCompletionRequest``, the response, chunk, message, tool-call and model-card models), kept apart
  from ``io_struct`` because two names (``Tool``, ``Function``) exist in both;
* the keys SGLang writes into responses (dict literals and ``x["key"] = ...``) in
  ``http_server.py``, ``managers/tokenizer_manager.py`` and ``utils/weight_versions.py``; and, more
  narrowly, the keys of each route's answer (:attr:`RouteSpec.answer`: its handler's dict literals, those of
  the module's helpers it calls, the fields of an ``io_struct`` output it serializes), of a
  ``meta_info.weight_versions`` span (``add_weight_versions_to_meta_info``) and of an abort's
  ``finish_reason`` (``managers/schedule_batch.py``: ``FINISH_ABORT.to_json``);
* ``server_args.py`` and the ``arg_groups/fields/*.py`` namespaces it assembles ``ServerArgs`` from
  (``_INPUT_NAMESPACES``): ``ServerArgs``' fields (what ``/server_info`` reports, with the keys
  ``build_server_info`` in ``utils/common.py`` and the handler add) and the command-line flags of
  ``python -m sglang.launch_server`` (one per field annotated ``A[T, "help"]`` or ``A[T, Arg(...)]``,
  as ``arg_utils.add_cli_args_from_dataclass`` derives them, plus ``ServerArgs.add_cli_args``' own
  ``parser.add_argument`` calls).

:func:`conformance_error` checks a JSON value against an annotation (``Optional``, ``Union``,
``List``, ``Dict``, ``Literal``, ``Annotated``, module-level aliases; types it cannot judge pass).

``python -m tests.sglang_spec --write`` rewrites the committed snapshot (``tests/data/sglang_spec.json``)
after a new pin has been reviewed.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
WHEEL_TAGS = ["--only-binary=:all:", "--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"]
SOURCES = {
    "http_server": "sglang/srt/entrypoints/http_server.py",
    "io_struct": "sglang/srt/managers/io_struct.py",
    "api_types": "sglang/api/v1/api_types.py",
    "tokenizer_manager": "sglang/srt/managers/tokenizer_manager.py",
    "weight_versions": "sglang/srt/utils/weight_versions.py",
    "openai_protocol": "sglang/srt/entrypoints/openai/protocol.py",
    "tokenizer_control": "sglang/srt/managers/tokenizer_control_mixin.py",
    "schedule_batch": "sglang/srt/managers/schedule_batch.py",
    "server_args": "sglang/srt/server_args.py",
    "common": "sglang/srt/utils/common.py",
}
SNAPSHOT = Path(__file__).parent / "data" / "sglang_spec.json"
METHODS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"], "delete": ["DELETE"], "patch": ["PATCH"]}


def wheel_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl" / "sglang-wheels"


def fetch_wheel(version: str = SGLANG_VERSION) -> Path:
    """The cached wheel, downloaded from PyPI the first time; RuntimeError says why it failed."""
    cache = wheel_cache()
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"sglang=={version}",
        "--no-deps",
        *WHEEL_TAGS,
        "--dest",
        str(cache),
        "--quiet",
        "--disable-pip-version-check",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"`{' '.join(cmd)}` did not finish in 600 s") from None
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"could not download the SGLang {version} wheel, which the conformance tests read "
            f"(needs access to PyPI, or the wheel in {cache}):\n$ {' '.join(cmd)}\n"
            f"{(done.stderr or done.stdout).strip()[-2000:]}"
        )
    return found[0]


def read_sources(wheel: Path) -> dict[str, str]:
    """``SOURCES`` by name, plus the modules ``server_args.py`` takes ``ServerArgs``' namespaces from
    (by module name, ``sglang.srt.arg_groups.fields.parallel`` ...)."""
    with zipfile.ZipFile(wheel) as z:
        sources = {name: z.read(path).decode() for name, path in SOURCES.items()}
        for module in sorted(set(namespace_modules(sources["server_args"]).values())):
            sources[module] = z.read(module.replace(".", "/") + ".py").decode()
    return sources


# ----------------------------------------------------------------------------- parsing


@dataclass
class FieldSpec:
    annotation: str
    required: bool
    default: str | None  # the default's source text


@dataclass
class RouteSpec:
    methods: list[str]
    handler: str
    request: str | None  # the request struct of the handler's body parameter
    auth: str  # normal | admin_optional | admin_force
    answer: set[str] = field(default_factory=set)  # keys its answer can carry (:func:`route_answers`)


@dataclass
class Spec:
    version: str
    routes: dict[str, RouteSpec]
    structs: dict[str, dict[str, FieldSpec]]  # io_struct classes (and api_types' SamplingParams)
    sampling_params: dict[str, FieldSpec]
    written_keys: set[str]
    annotations: dict[str, ast.expr] = field(repr=False, default_factory=dict)  # "Class.field" -> node
    aliases: dict[str, ast.expr] = field(repr=False, default_factory=dict)  # module-level type aliases
    classes: set[str] = field(repr=False, default_factory=set)
    openai_structs: dict[str, dict[str, FieldSpec]] = field(default_factory=dict)  # entrypoints/openai/protocol.py
    openai_annotations: dict[str, ast.expr] = field(repr=False, default_factory=dict)
    server_args: dict[str, FieldSpec] = field(default_factory=dict)  # ServerArgs' fields (its namespaces')
    server_flags: set[str] = field(default_factory=set)  # `python -m sglang.launch_server` flags
    server_info_keys: set[str] = field(default_factory=set)  # what /server_info reports
    span_keys: set[str] = field(default_factory=set)  # one meta_info.weight_versions span
    abort_keys: set[str] = field(default_factory=set)  # an abort's finish_reason

    def struct(self, name: str) -> dict[str, FieldSpec]:
        """The fields of a request struct (io_struct first, then the OpenAI models)."""
        return self.structs.get(name) or self.openai_structs.get(name) or {}

    def annotation(self, struct: str, name: str) -> ast.expr:
        key = f"{struct}.{name}"
        return self.annotations[key] if struct in self.structs else self.openai_annotations[key]

    def written(self, where: str) -> set[str]:
        """The keys SGLang writes at ``where``: ``"/generate"`` and ``"/generate meta_info"`` (any key a
        response can carry), ``"/generate meta_info.weight_versions[]"`` (a span),
        ``"/generate meta_info.finish_reason (abort)"``, ``"/server_info"``, or a route's answer (its path)."""
        if where in ("/generate", "/generate meta_info"):
            return self.written_keys
        if where == "/generate meta_info.weight_versions[]":
            return self.span_keys
        if where == "/generate meta_info.finish_reason (abort)":
            return self.abort_keys
        if where == "/server_info":
            return self.server_info_keys
        route = self.routes.get(where)
        return route.answer if route else set()


def _str(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _route_of(dec: ast.expr) -> tuple[str, list[str]] | None:
    """``@app.get("/p")``, ``@app.post("/p")``, ``@app.api_route("/p", methods=[...])``."""
    if not (
        isinstance(dec, ast.Call)
        and isinstance(dec.func, ast.Attribute)
        and isinstance(dec.func.value, ast.Name)
        and dec.func.value.id == "app"
    ):
        return None
    path = _str(dec.args[0]) if dec.args else None
    if path is None:  # a path from the environment (ollama, vertex ...): not a fixed route
        return None
    if dec.func.attr in METHODS:
        return path, METHODS[dec.func.attr]
    if dec.func.attr == "api_route":
        kw = {k.arg: k.value for k in dec.keywords}
        methods = kw.get("methods")
        return path, sorted(_str(m) for m in methods.elts) if isinstance(methods, ast.List) else ["GET"]
    return None


def _auth_of(dec: ast.expr) -> str | None:
    if isinstance(dec, ast.Call) and isinstance(dec.func, ast.Name) and dec.func.id == "auth_level" and dec.args:
        arg = dec.args[0]
        if isinstance(arg, ast.Attribute):
            return arg.attr.lower()
    return None


def _request_of(fn: ast.FunctionDef | ast.AsyncFunctionDef, classes: set[str]) -> str | None:
    for arg in fn.args.args + fn.args.kwonlyargs:
        ann = arg.annotation
        if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated":
            ann = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
        if isinstance(ann, ast.Name) and ann.id in classes:
            return ann.id
    return None


def parse_routes(source: str, classes: set[str]) -> dict[str, RouteSpec]:
    routes: dict[str, RouteSpec] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        auth = next((a for a in map(_auth_of, node.decorator_list) if a), "normal")
        for dec in node.decorator_list:
            route = _route_of(dec)
            if route is None:
                continue
            path, methods = route
            spec = routes.setdefault(path, RouteSpec([], node.name, _request_of(node, classes), auth))
            spec.methods = sorted(set(spec.methods) | set(methods))
    return routes


def _default_of(value: ast.expr | None) -> tuple[bool, str | None]:
    """(required, default source) of a class-body field; ``field(default=...)`` understood."""
    if value is None:
        return True, None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("field", "Field"):
        kw = {k.arg: k.value for k in value.keywords}
        if value.func.id == "Field" and value.args:  # pydantic's Field(default, ...)
            kw.setdefault("default", value.args[0])
        if "default" in kw:
            return False, ast.unparse(kw["default"])
        if "default_factory" in kw:
            return False, f"{ast.unparse(kw['default_factory'])}()"
        return True, None
    return False, ast.unparse(value)


def parse_structs(source: str, annotations: dict[str, ast.expr]) -> dict[str, dict[str, FieldSpec]]:
    tree = ast.parse(source)
    own: dict[str, dict[str, FieldSpec]] = {}
    bases: dict[str, list[str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
        fields: dict[str, FieldSpec] = {}
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                if "ClassVar" in ast.unparse(item.annotation) or item.target.id.startswith("_"):  # pydantic private
                    continue
                required, default = _default_of(item.value)
                fields[item.target.id] = FieldSpec(ast.unparse(item.annotation), required, default)
                annotations[f"{node.name}.{item.target.id}"] = item.annotation
        own[node.name] = fields

    def resolved(name: str) -> dict[str, FieldSpec]:
        out: dict[str, FieldSpec] = {}
        for base in bases.get(name, []):
            if base in own:
                out.update(resolved(base))
                for f in own[base]:
                    annotations.setdefault(f"{name}.{f}", annotations[f"{base}.{f}"])
        out.update(own[name])
        return out

    return {name: resolved(name) for name in own}


def parse_aliases(source: str) -> dict[str, ast.expr]:
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):  # `A = B = C` too (io_struct's LoRA outputs)
            out.update({t.id: node.value for t in node.targets if isinstance(t, ast.Name)})
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.value is not None
            and "TypeAlias" in ast.unparse(node.annotation)
        ):
            out[node.target.id] = node.value
    return out


def _keys_in(tree: ast.AST, subscripts: bool = True) -> set[str]:
    """String keys of dict literals and (``subscripts``) of ``x["key"] = ...`` targets under ``tree``."""
    keys: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys.update(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        elif subscripts and isinstance(node, (ast.Assign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Subscript) and _str(target.slice) is not None:
                    keys.add(_str(target.slice))
    return keys


def written_keys(*sources: str) -> set[str]:
    """What a response can carry: the keys (:func:`_keys_in`) of whole modules."""
    keys: set[str] = set()
    for source in sources:
        keys |= _keys_in(ast.parse(source))
    return keys


_Function = ast.FunctionDef | ast.AsyncFunctionDef


def functions(tree: ast.Module, cls: str | None = None) -> dict[str, _Function]:
    """The module's functions by name, or class ``cls``'s methods."""
    body = tree.body
    if cls is not None:
        body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), [])
    return {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _calls(tree: ast.AST) -> set[str]:
    """Names of the plain functions (``f(...)``) and methods (``x.f(...)``) called under ``tree``."""
    return {
        c.func.id if isinstance(c.func, ast.Name) else c.func.attr
        for c in ast.walk(tree)
        if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))
    }


def _struct_fields(name: str, structs: dict[str, dict[str, FieldSpec]], aliases: dict[str, ast.expr]) -> set[str]:
    for _ in range(10):  # follow `Output = OtherOutput` aliases
        if name in structs:
            return set(structs[name])
        alias = aliases.get(name)
        if not isinstance(alias, ast.Name):
            return set()
        name = alias.id
    return set()


TEXT = "<text>"  # in an answer's keys: the handler can answer a plain-text body (``Response(content=...)``)


def route_answers(
    http_server: ast.Module,
    routes: dict[str, RouteSpec],
    returns: dict[str, str],
    structs: dict[str, dict[str, FieldSpec]],
    aliases: dict[str, ast.expr],
) -> None:
    """Fill each route's :attr:`RouteSpec.answer`: the keys of its handler's dict literals and those of
    the module-level helpers it calls (``_create_error_response``), plus the fields of the ``io_struct``
    output it serializes (``result = await ...tokenizer_manager.m(...)`` then ``msgspec_to_builtins(result)``
    or ``return result``; ``returns`` is ``m`` -> its return annotation), plus :data:`TEXT` when it
    answers ``Response(content=...)`` (``/flush_cache``)."""
    module = functions(http_server)
    handlers = {n.name: n for n in ast.walk(http_server) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for route in routes.values():
        handler = handlers[route.handler]  # some are nested (registered by a function)
        keys = _keys_in(handler)
        for name in _calls(handler) & set(module) - {route.handler}:
            keys |= _keys_in(module[name])
        produced = {
            n.targets[0].id: n.value.value.func.attr
            for n in ast.walk(handler)
            if isinstance(n, ast.Assign)
            and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name)
            and isinstance(n.value, ast.Await)
            and isinstance(n.value.value, ast.Call)
            and isinstance(n.value.value.func, ast.Attribute)
        }
        sent = {
            a.id
            for c in ast.walk(handler)
            if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == "msgspec_to_builtins"
            for a in c.args
            if isinstance(a, ast.Name)
        }
        sent |= {r.value.id for r in ast.walk(handler) if isinstance(r, ast.Return) and isinstance(r.value, ast.Name)}
        for var, method in produced.items():
            if var in sent and method in returns:
                keys |= _struct_fields(returns[method], structs, aliases)
        if any(
            isinstance(c, ast.Call)
            and isinstance(c.func, ast.Name)
            and c.func.id in ("Response", "PlainTextResponse")
            and any(k.arg == "content" for k in c.keywords)
            for c in ast.walk(handler)
        ):
            keys.add(TEXT)
        route.answer = keys


def method_returns(*sources: str) -> dict[str, str]:
    """Method name -> the name of its return annotation, over every class of ``sources`` (the
    tokenizer manager and its mixins); the first source wins."""
    out: dict[str, str] = {}
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and isinstance(node.returns, ast.Name):
                out.setdefault(node.name, node.returns.id)
    return out


# ------------------------------------------------------------- ServerArgs: /server_info and flags


def namespace_modules(server_args: str) -> dict[str, str]:
    """``_INPUT_NAMESPACES``' classes (what ``ServerArgs`` is assembled from) -> the module each is
    imported from."""
    tree = ast.parse(server_args)
    imported = {
        a.asname or a.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for a in node.names
    }
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in targets):
            return {e.id: imported[e.id] for e in node.value.elts if isinstance(e, ast.Name) and e.id in imported}
    return {}


def _class_fields(tree: ast.Module, name: str) -> list[ast.AnnAssign]:
    body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), [])
    return [
        i
        for i in body
        if isinstance(i, ast.AnnAssign)
        and isinstance(i.target, ast.Name)
        and "ClassVar" not in ast.unparse(i.annotation)
    ]


def _cli_names(item: ast.AnnAssign) -> list[str]:
    """The flags ``add_cli_args_from_dataclass`` registers for one field: ``A[T, "help"]`` or
    ``A[T, Arg(...)]`` (the first of those in the metadata) gives ``--field-name`` (or ``cli_name``)
    and ``aliases``; no such metadata, or ``Arg(no_cli=True)``: none."""
    ann = item.annotation
    if not (
        isinstance(ann, ast.Subscript)
        and isinstance(ann.value, ast.Name)
        and ann.value.id in ("A", "Annotated")
        and isinstance(ann.slice, ast.Tuple)
    ):
        return []
    for meta in ann.slice.elts[1:]:
        if isinstance(meta, ast.JoinedStr) or _str(meta) is not None:
            return ["--" + item.target.id.replace("_", "-")]
        if isinstance(meta, ast.Call) and isinstance(meta.func, ast.Name) and meta.func.id == "Arg":
            kw = {k.arg: k.value for k in meta.keywords}
            if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value is True:
                return []
            aliases = kw.get("aliases")
            return [
                _str(kw.get("cli_name")) or "--" + item.target.id.replace("_", "-"),
                *(_str(a) for a in (aliases.elts if isinstance(aliases, ast.List) else []) if _str(a)),
            ]
    return []


def parse_server_args(sources: dict[str, str]) -> tuple[dict[str, FieldSpec], set[str]]:
    """``ServerArgs``' fields (those of its namespaces, then its own) and the flags of
    ``python -m sglang.launch_server`` (``prepare_server_args`` builds the parser with
    ``ServerArgs.add_cli_args``: the fields' flags, then its own ``parser.add_argument`` calls)."""
    fields: dict[str, FieldSpec] = {}
    flags: set[str] = set()
    own = ast.parse(sources["server_args"])
    for cls, module in [*namespace_modules(sources["server_args"]).items(), ("ServerArgs", None)]:
        tree = own if module is None else ast.parse(sources[module])
        for item in _class_fields(tree, cls):
            required, default = _default_of(item.value)
            ann = item.annotation  # A[T, help or Arg(...)]: T (the CLI metadata is not the field's type)
            if (
                isinstance(ann, ast.Subscript)
                and isinstance(ann.value, ast.Name)
                and ann.value.id in ("A", "Annotated")
                and isinstance(ann.slice, ast.Tuple)
            ):
                ann = ann.slice.elts[0]
            fields[item.target.id] = FieldSpec(ast.unparse(ann), required, default)
            flags.update(_cli_names(item))
    add_cli_args = functions(own, "ServerArgs").get("add_cli_args")
    for call in ast.walk(add_cli_args) if add_cli_args else []:
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument":
            flags.update(a for a in map(_str, call.args) if a and a.startswith("-"))
    return fields, flags


@functools.cache
def launch_server_flags(version: str = SGLANG_VERSION) -> frozenset[str]:
    """The flags ``python -m sglang.launch_server`` of the pinned wheel takes (:func:`parse_server_args`);
    RuntimeError when the wheel cannot be had (:func:`fetch_wheel`)."""
    return frozenset(parse_server_args(read_sources(fetch_wheel(version)))[1])


def server_info_keys(
    sources: dict[str, str], routes: dict[str, RouteSpec], server_args: dict[str, FieldSpec]
) -> set[str]:
    """What ``/server_info`` reports: its answer's own keys, plus ``build_server_info``'s (utils/common.py)
    when the handler calls it, plus ``ServerArgs``' fields and ``resolved_dict``'s extra keys when
    ``build_server_info`` starts from ``server_args.resolved_dict()``. (``scheduler_info``'s keys,
    merged in at run time, are not in the source.)"""
    route = routes.get("/server_info")
    if route is None:
        return set()
    keys = set(route.answer)
    handler = next(
        n
        for n in ast.walk(ast.parse(sources["http_server"]))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == route.handler
    )
    build = functions(ast.parse(sources["common"])).get("build_server_info")
    if build is not None and "build_server_info" in _calls(handler):
        keys |= _keys_in(build)
        resolved = functions(ast.parse(sources["server_args"]), "ServerArgs").get("resolved_dict")
        if resolved is not None and "resolved_dict" in _calls(build):
            keys |= set(server_args) | _keys_in(resolved)
    return keys


def load_spec(sources: dict[str, str]) -> Spec:
    annotations: dict[str, ast.expr] = {}
    structs = parse_structs(sources["io_struct"], annotations)
    contract: dict[str, ast.expr] = {}
    sampling = parse_structs(sources["api_types"], contract)["SamplingParams"]
    annotations.update({k: v for k, v in contract.items() if k.startswith("SamplingParams.")})
    openai_annotations: dict[str, ast.expr] = {}
    openai = parse_structs(sources["openai_protocol"], openai_annotations)
    aliases = {
        **parse_aliases(sources["openai_protocol"]),
        **parse_aliases(sources["api_types"]),
        **parse_aliases(sources["io_struct"]),
    }
    routes = parse_routes(sources["http_server"], set(structs) | set(openai))
    route_answers(
        ast.parse(sources["http_server"]),
        routes,
        method_returns(sources["tokenizer_manager"], sources["tokenizer_control"]),
        structs,
        parse_aliases(sources["io_struct"]),
    )
    server_args, flags = parse_server_args(sources)
    batch = ast.parse(sources["schedule_batch"])
    spans = functions(ast.parse(sources["weight_versions"])).get("add_weight_versions_to_meta_info")
    to_json = functions(batch, "FINISH_ABORT").get("to_json")
    return Spec(
        version=SGLANG_VERSION,
        routes=routes,
        structs=structs,
        sampling_params=sampling,
        written_keys=written_keys(sources["http_server"], sources["tokenizer_manager"], sources["weight_versions"]),
        annotations=annotations,
        aliases=aliases,
        classes=set(structs) | set(openai),
        openai_structs=openai,
        openai_annotations=openai_annotations,
        server_args=server_args,
        server_flags=flags,
        server_info_keys=server_info_keys(sources, routes, server_args),
        span_keys=_keys_in(spans, subscripts=False) if spans else set(),  # the span dicts, not meta_info's keys
        abort_keys=_keys_in(to_json) if to_json else set(),
    )


# ------------------------------------------------------------------ values vs annotations

_SCALARS = {"str": str, "int": int, "float": float, "bool": bool}
# Python-only types in SGLang's annotations (an in-process PIL image, raw bytes, a tensor): no JSON value is one,
# so inside a union they must not make any value pass (``image_data``'s items are str | bytes | dict | Image ...)
_NOT_JSON = {"bytes", "Image", "Tensor", "ndarray"}
_OBJECTS = {"ImageData", "VideoData"}  # dataclasses imported into io_struct from elsewhere: objects over JSON
_ARRAYS = {"List", "list", "Set", "set", "Tuple", "tuple", "Sequence", "FrozenSet"}
_MAPS = {"Dict", "dict", "Mapping"}


def conformance_error(value: Any, node: ast.expr, spec: Spec, where: str, depth: int = 0) -> str | None:
    """None when ``value`` (parsed JSON) fits the annotation ``node``, else what is wrong."""
    if depth > 20:
        return None
    if isinstance(node, ast.Constant) and node.value is None:
        return None if value is None else f"{where} must be null, got {value!r}"
    if isinstance(node, ast.Name):
        if node.id in ("Any", "object"):
            return None
        if node.id in _SCALARS:
            kind = _SCALARS[node.id]
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            return None if ok else f"{where} must be {node.id}, got {value!r}"
        if node.id in _ARRAYS:
            return None if isinstance(value, list) else f"{where} must be a list, got {value!r}"
        if node.id in _MAPS:
            return None if isinstance(value, dict) else f"{where} must be an object, got {value!r}"
        if node.id in spec.aliases:
            return conformance_error(value, spec.aliases[node.id], spec, where, depth + 1)
        if node.id in spec.classes or node.id in _OBJECTS:
            return None if isinstance(value, dict) else f"{where} must be an object ({node.id}), got {value!r}"
        if node.id in _NOT_JSON:
            return f"{where} cannot be a {node.id} over HTTP, got {value!r}"
        return None  # a type this check cannot judge (enums ...)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | Y
        return _first_fit(value, [node.left, node.right], spec, where, depth)
    if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
        head = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            return None if value is None else conformance_error(value, args[0], spec, where, depth + 1)
        if head == "Union":
            return _first_fit(value, args, spec, where, depth)
        if head == "Annotated":
            return conformance_error(value, args[0], spec, where, depth + 1)
        if head == "Literal":
            allowed = [a.value for a in args if isinstance(a, ast.Constant)]
            return None if value in allowed else f"{where} must be one of {allowed}, got {value!r}"
        if head in _ARRAYS:
            if not isinstance(value, list):
                return f"{where} must be a list, got {value!r}"
            if head in ("Tuple", "tuple") and not (len(args) == 2 and isinstance(args[1], ast.Constant)):
                return None  # fixed-shape tuples: not judged
            for i, item in enumerate(value):
                err = conformance_error(item, args[0], spec, f"{where}[{i}]", depth + 1)
                if err:
                    return err
            return None
        if head in _MAPS:
            if not isinstance(value, dict):
                return f"{where} must be an object, got {value!r}"
            for k, item in value.items():
                err = conformance_error(item, args[-1], spec, f"{where}.{k}", depth + 1)
                if err:
                    return err
            return None
    return None


def _first_fit(value: Any, options: list[ast.expr], spec: Spec, where: str, depth: int) -> str | None:
    errors = [conformance_error(value, o, spec, where, depth + 1) for o in options]
    return None if any(e is None for e in errors) else "; or ".join(e for e in errors if e)


# --------------------------------------------------------------------------- snapshot


def _field_text(f: FieldSpec) -> str:
    return f"{f.annotation}, required" if f.required else f"{f.annotation} = {f.default}"


def relied_on(
    spec: Spec, fields_read: dict[str, set[str]], reads: dict[str, tuple[str, ...]], answer_keys: tuple[str, ...] = ()
) -> dict:
    """The part of the spec agentrl relies on, as JSON: for each route (path -> the request fields
    agentrl reads or sends), its methods, handler, auth level and those fields plus every required
    one (``"annotation = default"`` or ``"annotation, required"``) and which of ``answer_keys`` its
    answer carries; the sampling_params contract; for each place agentrl reads (``reads``: where, see
    :meth:`Spec.written` -> keys), whether SGLang writes each key there; the ``ServerArgs`` fields
    behind the ``/server_info`` keys agentrl reads."""
    routes: dict[str, Any] = {}
    for path in sorted(fields_read):
        r = spec.routes.get(path)
        if r is None:
            routes[path] = None
            continue
        fields = spec.struct(r.request) if r.request else {}
        kept = {k: _field_text(f) for k, f in fields.items() if k in fields_read[path] or f.required}
        kept.update({k: None for k in fields_read[path] if k not in fields})  # read, but not SGLang's
        routes[path] = {
            "methods": ",".join(r.methods),
            "handler": r.handler,
            "request": r.request,
            "auth": r.auth,
            "fields": dict(sorted(kept.items())),
            "answer": sorted(r.answer & set(answer_keys)),
        }
    server_info = sorted(reads.get("/server_info", ()))
    return {
        "version": spec.version,
        "routes": routes,
        "sampling_params": {k: _field_text(f) for k, f in sorted(spec.sampling_params.items())},
        "response_keys_written": {
            where: {k: k in spec.written(where) for k in sorted(keys)} for where, keys in sorted(reads.items())
        },
        "server_args": {k: _field_text(spec.server_args[k]) if k in spec.server_args else None for k in server_info},
    }


def diff(old: Any, new: Any, where: str = "") -> list[str]:
    """Readable differences between two JSON values, one line each."""
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for k in sorted(set(old) | set(new)):
            here = f"{where}.{k}" if where else k
            if k not in new:
                lines.append(f"- {here}: {json.dumps(old[k])} (gone)")
            elif k not in old:
                lines.append(f"+ {here}: {json.dumps(new[k])} (new)")
            else:
                lines += diff(old[k], new[k], here)
        return lines
    return [] if old == new else [f"~ {where}: {json.dumps(old)} -> {json.dumps(new)}"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.sglang_spec --write   (rewrites the snapshot from the pinned wheel)")
    from tests.test_engine_conformance import relied_on_now

    SNAPSHOT.parent.mkdir(exist_ok=True)
    SNAPSHOT.write_text(json.dumps(relied_on_now(load_spec(read_sources(fetch_wheel()))), indent=1) + "\n")
    print(f"wrote {SNAPSHOT}")
