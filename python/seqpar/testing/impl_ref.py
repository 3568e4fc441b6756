"""References to a user's attention function that survive a process boundary and a shell:
"path/to/file.py:EXPR" or "package.module:EXPR", EXPR evaluated in that module (a name, a
dotted attribute, or a call such as make_attention(bug='x'))."""
import importlib
import importlib.util
import inspect
import os
import sys


def resolve(ref):
    """The callable a reference names."""
    if ":" not in ref:
        raise ValueError("implementation %r: use FILE.py:NAME or MODULE:NAME" % ref)
    i = ref.index(".py:") + 3 if ".py:" in ref else ref.index(":")
    where, expr = ref[:i], ref[i + 1:]
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.isfile(path):
            raise ValueError("implementation %r: no file %s" % (ref, path))
        d = os.path.dirname(path)
        if d not in sys.path:
            sys.path.insert(0, d)
        name = "seqpar_user_" + os.path.splitext(os.path.basename(path))[0]
        mod = sys.modules.get(name)
        if mod is None or getattr(mod, "__file__", None) != path:
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    try:
        fn = eval(expr, vars(mod))  # noqa: S307 (the user's own reference to their own code)
    except Exception as e:
        raise ValueError("implementation %r: %s in %s: %s" % (ref, expr, where, e))
    if not callable(fn):
        raise ValueError("implementation %r names %r, which is not callable" % (ref, fn))
    return fn


def declared_supports(fn):
    """The SUPPORTS that the module defining `fn` declares at its top level (a dict or a
    Supports), or None where it declares none. One that is not valid is refused naming the file
    that declares it."""
    from .scenario import Supports

    mod = sys.modules.get(getattr(fn, "__module__", None) or "")
    declared = getattr(mod, "SUPPORTS", None)
    if declared is not None:
        try:
            Supports.of(declared)
        except (TypeError, ValueError) as e:
            where = getattr(mod, "__file__", None) or fn.__module__
            raise ValueError("the SUPPORTS that %s declares is not valid: %s; fix it there, or "
                             "give supports= (--supports) to override it" % (where, e))
    return declared


def reference_of(fn):
    """A FILE.py:NAME reference for a module-level function, else None."""
    qual = getattr(fn, "__qualname__", None)
    if not qual or "<locals>" in qual or "<lambda>" in qual:
        return None
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        return None
    if not path:
        return None
    rel = os.path.relpath(path)
    return "%s:%s" % (rel if not rel.startswith("..") else path, qual)
