#!/bin/bash
# Packs this machine's nginx (Debian 12) for the device machine, which has none: .devtools/nginx/ holds
# the binary, the libraries it links (used only where the device machine lacks one) and a wrapper
# named `nginx`. Run here once; the device scripts that need nginx (replicas.sh) put the folder on
# PATH when the call carries it:  run(..., carry=[".devtools/nginx", ...])
set -euo pipefail
bin=$(command -v nginx || echo /usr/sbin/nginx)
[ -x "$bin" ] || { echo "no nginx here (Debian: apt-get install nginx)"; exit 2; }
dest=.devtools/nginx
rm -rf "$dest"; mkdir -p "$dest/lib"
cp "$bin" "$dest/nginx.bin"
ldd "$bin" | awk '/=> \// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|ld-linux)[.-]' | while read -r lib; do
  cp -L "$lib" "$dest/lib/"
done
cat > "$dest/nginx" <<'WRAP'
#!/bin/sh
# Debian's nginx on another distribution: its own copies of the libraries the machine lacks, no others
d=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$d/use"
for l in $(LD_LIBRARY_PATH= ldd "$d/nginx.bin" | awk '/not found/ {print $1}'); do ln -sf "$d/lib/$l" "$d/use/$l"; done
LD_LIBRARY_PATH="$d/use${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$d/nginx.bin" "$@"
WRAP
chmod +x "$dest/nginx"
du -sh "$dest"; "$dest/nginx" -v
