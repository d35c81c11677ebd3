"""Imported at start-up by stagelink.pth, only where STAGELINK_SGLANG_OMNI is set: when
SGLang-Omni's relay registry (sglang_omni.relay.base) or its own shm relay module is imported,
stagelink.integrations.sglang_omni.install runs right after it (see that module)."""
import sys

_WATCHED = ("sglang_omni.relay.base", "sglang_omni.relay.shm")


def _install(_module):
    try:
        from stagelink.integrations import sglang_omni
        sglang_omni.install(base=sys.modules["sglang_omni.relay.base"])
    except Exception as e:  # never break the framework's import; say why
        import logging
        logging.getLogger("stagelink").warning("STAGELINK_SGLANG_OMNI: stagelink's relay not installed: %r", e)


class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name not in _WATCHED:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module):
            run(module)
            _install(module)
        loader.exec_module = exec_module
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
