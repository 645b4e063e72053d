#!/usr/bin/env bash
# Stage the offline GPU kit for the lent device machine, one folder per device call.
# Each call carries the checkout (tracked + untracked files) plus one `.kit` folder, 64 MiB in
# all; the checkout grows with committed results, so the kit is re-split into parts that fit
# beside it (4 MiB margin) and the SHA256SUMS is rewritten for the new parts. The last folder
# also holds install_wheelhouse.sh, the model shapes and the traces.
# Run `scripts/gpu/travel-light.sh on` first: the parts then grow to ~58 MiB (6 calls, not 9).
# Usage: kit-parts.sh KIT_DIR STAGE_DIR   (KIT_DIR: what ../shared/gpu/build_wheelhouse.sh made)
# Then per call: rm -rf .kit && cp -rl STAGE_DIR/NN .kit ; carry [".kit"] ; on the device
# `mkdir -p /root/kit && cp -r .kit/* /root/kit/`; in the last call also
# `bash /root/kit/install_wheelhouse.sh /root/kit /root/site` and
# `python3 -m pip install --no-deps -q --target /root/site /root/kit/extra-wheels/*.whl`.
set -euo pipefail
kit=${1:?kit dir}; stage=${2:?stage dir}
parts_dir=$kit/parts; [ -d "$parts_dir" ] || parts_dir=$kit
shopt -s nullglob
parts=("$parts_dir"/kit.tar.part.*)
[ ${#parts[@]} -gt 0 ] || { echo "kit-parts.sh: no kit.tar.part.* in $parts_dir" >&2; exit 2; }
# What travels: tracked files present in the working tree and untracked files git does not ignore.
tracked_kib=$(cd "$(dirname "$0")/../.." && python3 - <<'PY'
import os, subprocess
names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, check=True).stdout.split(b"\0")
print(sum(os.path.getsize(n) for n in names if n and os.path.isfile(n)) // 1024)
PY
)
part_mib=$(( (64 * 1024 - tracked_kib) / 1024 - 4 ))
[ "$part_mib" -ge 8 ] || { echo "kit-parts.sh: the checkout ($tracked_kib KiB) leaves no room for a part" >&2; exit 2; }
rm -rf "$stage" && mkdir -p "$stage/split"
cat "${parts[@]}" | split -b "${part_mib}M" -d - "$stage/split/kit.tar.part."
(cd "$stage/split" && sha256sum kit.tar.part.* > SHA256SUMS)
last=
for part in "$stage"/split/kit.tar.part.*; do
  last=${part##*.}
  mkdir -p "$stage/$last" && mv "$part" "$stage/$last/"
done
mv "$stage/split/SHA256SUMS" "$stage/$last/" && rmdir "$stage/split"
shared=$(cd "$(dirname "$0")/../../.." && pwd)/shared
cp -r "$shared/gpu/install_wheelhouse.sh" "$shared/gpu/models" "$shared"/traces/azure_*_2023.csv "$stage/$last/"
# vLLM 0.24's OpenAI server (`vllm serve`, i.e. --server vllm) imports these; the kit lacks them.
python3 -m pip download --no-deps -q -d "$stage/$last/extra-wheels" \
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
echo "staged $(ls "$stage" | wc -l) calls of <= $part_mib MiB in $stage (checkout $((tracked_kib / 1024)) MiB)"
