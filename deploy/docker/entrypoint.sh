#!/bin/sh
# Runs `orca-jax "$@"` (CMD is `serve ...`). The native attention kernel was compiled at image build
# into $ORCA_JAX_PREBUILT/native; the compilation-cache volume mounted on $ORCA_JAX_COMPILATION_CACHE
# hides the image's copy, so seed the volume with it (never overwriting a build already there).
set -eu
if [ -d "${ORCA_JAX_PREBUILT:-}/native" ]; then
    mkdir -p "$ORCA_JAX_COMPILATION_CACHE/native"
    cp -n "$ORCA_JAX_PREBUILT"/native/*.so "$ORCA_JAX_COMPILATION_CACHE/native/" 2>/dev/null || true
fi
# exec: the server is PID 1's process itself, so SIGTERM from the kubelet or `docker stop` reaches it
# and drains (in-flight requests get --shutdown-timeout seconds to finish).
exec orca-jax "$@"
