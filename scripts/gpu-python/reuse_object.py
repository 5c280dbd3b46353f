#!/usr/bin/env python3
"""The rehearsal's compiler launcher for the GPU kit's Python extension build
(scripts/gpu-bundle-rehearse.sh, through scripts/gpu-check.sh):

    reuse_object.py BUILD_DIR COMPILER ARGS...

Compiling the extension takes minutes on CI's two cores, so where the kit's file is the
build's, the build's object is taken. "The same" is checked, not assumed: the kit's
command and the build's (BUILD_DIR/compile_commands.json) are both preprocessed, and the
object is taken only if the two sources are the same, token for token. The kit's
preprocessing must also find every third-party header in the bundle (python-kit/sysroot/),
never in this machine's folders that the bundle mirrors: a header the bundle lacks fails
here as it would on the GPU machine. Otherwise the file is compiled (printed as such)."""
import json
import os
import shlex
import subprocess
import sys

MARKER = "/python-kit/source/"


def option(args, name):
    return args[args.index(name) + 1] if name in args else None


def preprocess(args, out, cwd=None):
    """ARGS (a compile command) preprocessed into OUT without line markers."""
    args = list(args)
    args[args.index("-o") + 1] = out
    return subprocess.run(args + ["-E", "-P"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def system_headers_used(depfile, bundle):
    """Headers the kit's preprocessing took from this machine's folders that the bundle
    mirrors (kit.cmake's, and the folders of /usr/include that sysroot/ holds)."""
    kit = open(os.path.join(bundle, "python-kit", "kit.cmake")).read()
    dirs = kit.split("MESHRT_KIT_SYSTEM_INCLUDE_DIRS \"", 1)[1].split("\"", 1)[0].split(";")
    mirrored = [d for d in dirs if d and d != "/usr/include"]
    usr = os.path.join(bundle, "python-kit", "sysroot", "usr", "include")
    if os.path.isdir(usr):
        mirrored += ["/usr/include/" + t for t in os.listdir(usr) if os.path.isdir(os.path.join(usr, t))]
    deps = open(depfile).read().replace("\\\n", " ").split()
    return sorted({d for d in deps if any(d.startswith(m.rstrip("/") + "/") for m in mirrored)})


def main():
    build, cmd = sys.argv[1], sys.argv[2:]
    src, obj = option(cmd, "-c"), option(cmd, "-o")
    if not src or not obj or MARKER not in src:
        os.execvp(cmd[0], cmd)
    rel = "python/" + src.split(MARKER, 1)[1]
    bundle = src.split(MARKER, 1)[0]
    entry = None
    with open(os.path.join(build, "compile_commands.json")) as f:
        for e in json.load(f):
            if e["file"].endswith("/" + rel) and "meshrt_python.dir" in e.get("output", e.get("command", "")):
                entry = e
    built = None
    if entry:
        bargs = shlex.split(entry["command"]) if "command" in entry else entry["arguments"]
        built = os.path.join(entry["directory"], option(bargs, "-o"))
    if not entry or not os.path.exists(built):
        print(f"reuse_object: compiled {rel}: the build at {build} has no object of it", flush=True)
        os.execvp(cmd[0], cmd)

    # The kit's preprocessing writes the dependency file the build tool reads.
    kit_cmd = list(cmd)
    depfile = option(kit_cmd, "-MF")
    if not depfile:
        depfile = obj + ".d"
        kit_cmd += ["-MD", "-MF", depfile]
    kit_i, build_i = os.path.abspath(obj + ".kit.i"), os.path.abspath(obj + ".build.i")
    mine = preprocess(kit_cmd, kit_i)
    if mine.returncode != 0:
        sys.stderr.write(f"reuse_object: the kit's files do not preprocess {rel}:\n{mine.stdout}")
        return mine.returncode
    leaked = system_headers_used(depfile, bundle)
    if leaked:
        sys.stderr.write(f"reuse_object: {rel}: expected every third-party header from the bundle's python-kit/sysroot/, "
                         f"found {len(leaked)} taken from this machine instead (the bundle lacks them: "
                         f"scripts/gpu-bundle.sh): {' '.join(leaked[:5])}\n")
        return 1
    theirs = preprocess(bargs, build_i, cwd=entry["directory"])
    same = theirs.returncode == 0 and open(kit_i, "rb").read() == open(build_i, "rb").read()
    for f in (kit_i, build_i):
        if os.path.exists(f):
            os.remove(f)
    if not same:
        print(f"reuse_object: compiled {rel}: its preprocessed source differs from the build's", flush=True)
        os.execvp(cmd[0], cmd)
    with open(built, "rb") as f, open(obj, "wb") as out:
        out.write(f.read())
    print(f"reuse_object: reused {rel}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
