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

``library(cache_dir)`` compiles the source with ``cc`` once per source hash; without a compiler (or when
the compile fails) it returns None and the launcher falls back to the token on the command line (logged).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["PLACEHOLDER", "SOURCE", "library"]

LOGGER = logging.getLogger(__name__)

PLACEHOLDER = "@NNUNET_TRITON_CONTROL_TOKEN@"

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
#define TOKEN_ENV "NNUNET_TRITON_CONTROL_TOKEN"

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

static void substitute_token(int argc, char **argv, char **envp) {
    (void)envp;
    const char *token = getenv(TOKEN_ENV);
    if (!token) return;
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
    unsetenv(TOKEN_ENV);
}

__attribute__((section(".init_array"), used))
static void (*nnunet_triton_init)(int, char **, char **) = substitute_token;
""".replace("@PLACEHOLDER@", PLACEHOLDER)


def library(cache_dir: str | Path) -> Path | None:
    """The compiled library under ``cache_dir`` (made 0700), built with ``cc`` when its source changed; None
    when no C compiler is installed."""
    cache = Path(cache_dir)
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    built = cache / f"nnunet_triton_preload-{digest}.so"
    if built.is_file():
        return built
    compiler = shutil.which("cc")
    if compiler is None:
        LOGGER.warning("no C compiler (cc) found: the control token stays on tritonserver's command line and "
                       "/dev/shm regions stay 0644 (install gcc; docs/security.md)")
        return None
    cache.mkdir(parents=True, exist_ok=True)
    cache.chmod(0o700)  # nobody else may replace the library the server preloads
    source = cache / f"preload-{digest}.c"
    source.write_text(SOURCE)
    partial = built.with_suffix(f".{os.getpid()}.tmp")
    result = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(partial), str(source),
                             "-ldl"], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        LOGGER.warning("compiling %s with %s failed (the control token stays on tritonserver's command line, "
                       "/dev/shm regions stay 0644):\n%s", source, compiler, result.stderr)
        return None
    os.replace(partial, built)
    return built
