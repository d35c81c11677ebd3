# The one place stagelink's version is written: the Python package (__version__, `stagelink
# --version`), the wheel's metadata (pyproject.toml reads it) and the C++ library's CMake package
# and pkg-config file (CMakeLists.txt reads it) all take it from here.
__version__ = "0.1.0"
