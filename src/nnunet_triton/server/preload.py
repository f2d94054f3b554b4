"""A tiny ``LD_PRELOAD`` library for tritonserver and its stubs: the control token off the command line, and
private ``/dev/shm`` regions.

Triton 2.51 takes the restricted-API token only as a flag (``--http-restricted-api=...:key=value``), and
every local user can read ``/proc/<pid>/cmdline``. The launcher therefore passes ``PLACEHOLDER`` in the
flags and the token in the environment (``/proc/<pid>/environ`` is readable by the owner only); a
constructor of this library runs before tritonserver's ``main``, points the flags' ``argv`` entries at
copies holding the token, and removes the variable from the environment (the stubs never see it).
``/proc/<pid>/cmdline`` keeps showing the placeholder: the kernel reads the original argument area, not
the pointers.

The Python backend creates each stub's region with Boost.Interprocess, which ``fchmod``\\ s it to 0644 after
creating it (so the umask does not apply); the library's ``shm_open`` and ``fchmod`` keep the owner's bits
only for ``/dev/shm`` objects, so another local user cannot read the images in flight.

``/proc/<pid>/environ`` shows the environment block the kernel copied at ``exec``, not the variables:
the constructor therefore overwrites the token's bytes in that block (with ``*``) before it removes the
variable, so the server's own ``/proc/<pid>/environ`` no longer holds it.

The same library takes the token off perf_analyzer's command line (``-H name:PLACEHOLDER``,
:func:`environment`): ``PROGRAM_ENV`` names the one program that may take the token, so a wrapper
script on the way (perf_analyzer's ``bash`` launcher, ``env``) leaves argv and the variable alone and
passes both on to the program it ``exec``\\ s.

:func:`library` compiles the source with ``cc`` once per source hash into a cache folder; :func:`build`
compiles it to a given path (a Dockerfile's build step: ``python -m nnunet_triton.server.preload OUT.so``).
Both raise :class:`~nnunet_triton.errors.PreloadUnavailableError` naming what is missing (no ``cc``, or
the compiler's error): the launcher refuses to start without the library unless told the consequence
(``server.embedded``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from nnunet_triton.errors import PreloadUnavailableError
from nnunet_triton.exit_codes import ExitCode

__all__ = ["CONSEQUENCE", "PLACEHOLDER", "PROGRAM_ENV", "SOURCE", "TOKEN_ENV", "build", "environment",
           "library"]

PLACEHOLDER = "@NNUNET_TRITON_CONTROL_TOKEN@"
TOKEN_ENV = "NNUNET_TRITON_CONTROL_TOKEN"  # = model_control.TOKEN_ENV (this module imports no server code)
# the basename of the one executable whose argv takes the token (unset: any program the library is loaded in)
PROGRAM_ENV = "NNUNET_TRITON_PRELOAD_PROGRAM"
# what a server started without the library exposes (the launcher's error and its degraded state say it)
CONSEQUENCE = ("the control token on tritonserver's command line (/proc/<pid>/cmdline, readable by every "
               "local user: it opens the model-repository API, and a model load runs code as the server's "
               "user) and the Python stubs' /dev/shm regions 0644 (every local user reads the images in "
               "flight)")

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define PLACEHOLDER "@PLACEHOLDER@"
#define TOKEN_ENV "@TOKEN_ENV@"
#define PROGRAM_ENV "@PROGRAM_ENV@"

static int in_dev_shm(int fd) {
    char link[64], target[512];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = '\0';
    return strncmp(target, "/dev/shm/", 9) == 0;
}

int fchmod(int fd, mode_t mode) {
    static int (*real_fchmod)(int, mode_t);
    if (!real_fchmod) real_fchmod = (int (*)(int, mode_t))dlsym(RTLD_NEXT, "fchmod");
    if (in_dev_shm(fd)) mode &= S_IRWXU;
    return real_fchmod(fd, mode);
}

int shm_open(const char *name, int oflag, mode_t mode) {
    static int (*real_shm_open)(const char *, int, mode_t);
    if (!real_shm_open) real_shm_open = (int (*)(const char *, int, mode_t))dlsym(RTLD_NEXT, "shm_open");
    return real_shm_open(name, oflag, mode & S_IRWXU);
}

static int is_the_program(void) {
    const char *only = getenv(PROGRAM_ENV);
    if (!only || !*only) return 1;
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n < 0) return 0;
    exe[n] = '\0';
    const char *base = strrchr(exe, '/');
    return strcmp(base ? base + 1 : exe, only) == 0;
}

/* /proc/<pid>/environ reads the block the kernel copied at exec: overwrite the value there */
static void wipe_from_environment_block(char **envp) {
    size_t name = strlen(TOKEN_ENV);
    for (char **entry = envp; entry && *entry; entry++) {
        if (strncmp(*entry, TOKEN_ENV, name) == 0 && (*entry)[name] == '=') {
            for (char *c = *entry + name + 1; *c; c++) *c = '*';
        }
    }
}

static void substitute_token(int argc, char **argv, char **envp) {
    const char *found = getenv(TOKEN_ENV);
    if (!found || !is_the_program()) return;
    char *token = strdup(found);
    if (!token) abort();
    size_t placeholder = strlen(PLACEHOLDER);
    for (int i = 0; i < argc; i++) {
        char *at = strstr(argv[i], PLACEHOLDER);
        if (!at) continue;
        size_t head = (size_t)(at - argv[i]);
        char *arg = malloc(strlen(argv[i]) - placeholder + strlen(token) + 1);
        if (!arg) abort();
        memcpy(arg, argv[i], head);
        strcpy(arg + head, token);
        strcat(arg, at + placeholder);
        argv[i] = arg;
    }
    wipe_from_environment_block(envp);
    unsetenv(TOKEN_ENV);
    unsetenv(PROGRAM_ENV);
}

__attribute__((section(".init_array"), used))
static void (*nnunet_triton_init)(int, char **, char **) = substitute_token;
""".replace("@PLACEHOLDER@", PLACEHOLDER).replace("@TOKEN_ENV@", TOKEN_ENV).replace(
    "@PROGRAM_ENV@", PROGRAM_ENV)


def build(out: str | Path, *, compiler: str | None = None) -> Path:
    """Compile the library to ``out`` (atomically: a partial file is never at ``out``).

    Raises:
        PreloadUnavailableError: no C compiler (``cc`` on PATH, or ``compiler``), or the compile failed
            (the compiler's own error in the message).
    """
    out = Path(out)
    compiler = compiler or shutil.which("cc")
    if compiler is None:
        raise PreloadUnavailableError("no C compiler (`cc`) on PATH to build the preload library "
                                      "(server/preload.py); install gcc")
    out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    source = out.with_name(f"preload-{digest}.{os.getpid()}.c")
    partial = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    source.write_text(SOURCE)
    try:
        result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(partial),
                                 str(source), "-ldl"], capture_output=True, text=True, check=False)
    finally:
        source.unlink(missing_ok=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise PreloadUnavailableError(f"compiling the preload library (server/preload.py) with {compiler} "
                                      f"failed:\n{result.stderr.strip()}")
    os.replace(partial, out)
    return out


def library(cache_dir: str | Path) -> Path:
    """The compiled library under ``cache_dir`` (made 0700), built with ``cc`` when its source changed.

    Raises:
        PreloadUnavailableError: it is not there and cannot be built (:func:`build`).
    """
    cache = Path(cache_dir)
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    built = cache / f"nnunet_triton_preload-{digest}.so"
    if built.is_file():
        return built
    cache.mkdir(parents=True, exist_ok=True)
    cache.chmod(0o700)  # nobody else may replace the library the server preloads
    return build(built)


def environment(library_path: str | Path, token: str, program: str,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the library preloaded and ``token`` for the
    executable named ``program`` only: its argv's :data:`PLACEHOLDER` becomes the token before ``main``."""
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = " ".join(p for p in (str(library_path), env.get("LD_PRELOAD")) if p)
    env[TOKEN_ENV] = token
    env[PROGRAM_ENV] = program
    return env


def main(argv: list[str] | None = None) -> int:
    """``python -m nnunet_triton.server.preload OUT.so``: compile the library to ``OUT.so`` (an image's
    build step); exit 2 with the reason when it cannot."""
    parser = argparse.ArgumentParser(prog="python -m nnunet_triton.server.preload", description=main.__doc__)
    parser.add_argument("out", type=Path, help="where the shared library goes")
    parser.add_argument("--compiler", default=None, help="the C compiler (default: cc on PATH)")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(f"{build(args.out, compiler=args.compiler)}\n")
    except PreloadUnavailableError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return ExitCode.USAGE
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
