#!/usr/bin/env bash
# The release size of the layer guide's first example ("Use the layer", served by axum::serve)
# with the crate's default features, with none, and with every Redis feature, against a
# bare axum hello-world: each built in a temporary crate that depends on this checkout by
# path, with this checkout's Cargo.lock (so the same versions as the crate's own build).
#
#   bash benches/size.sh
#
# Prints each binary's size as built (cargo's release profile, which keeps the symbol
# table) and stripped (`strip`, when installed). Honours CARGO_TARGET_DIR (the builds
# share it; each binary is copied out before the next build). Takes a few minutes per
# feature set on a cold target directory.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

mkdir -p "$work/sizes/src/bin"
cat >"$work/sizes/Cargo.toml" <<EOF
[package]
name = "sizes"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
axum = "0.8"
tokio = { version = "1", features = ["macros", "rt-multi-thread", "net"] }
stampede-guard = { path = "$repo", default-features = false }

[features]
default = ["stampede-guard/default"]
redis-all = ["stampede-guard/tls", "stampede-guard/cluster", "stampede-guard/sentinel"]

[workspace]
EOF
cp "$repo/Cargo.lock" "$work/sizes/Cargo.lock"

cat >"$work/sizes/src/bin/bare.rs" <<'EOF'
use axum::{Router, routing::get};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let app = Router::new().route("/", get(|| async { "hello" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app).await?;
    Ok(())
}
EOF

# The layer guide's example as it stands: the first Rust block under "## Use the layer".
{
  awk '/^## Use the layer/ { found = 1 }
       found && /^```rust/ { inside = 1; next }
       inside && /^```/ { exit }
       inside { print }' "$repo/docs/layer.md"
  cat <<'EOF'

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    axum::serve(listener, app().await?).await?;
    Ok(())
}
EOF
} >"$work/sizes/src/bin/readme.rs"
grep -q "StampedeGuard::builder" "$work/sizes/src/bin/readme.rs" || {
  echo "docs/layer.md's \"Use the layer\" example was not found" >&2
  exit 1
}

target="${CARGO_TARGET_DIR:-$work/target}"
build() { # NAME BIN CARGO-FLAGS...
  local name="$1" bin="$2"
  shift 2
  (cd "$work/sizes" && CARGO_TARGET_DIR="$target" cargo build --quiet --release --bin "$bin" "$@")
  cp "$target/release/$bin" "$work/$name"
}
build bare bare
build default readme
build least readme --no-default-features
build all readme --features redis-all

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
printf '%-58s %12s %12s\n' "release binary" "as built" "stripped"
for row in "bare:bare axum hello-world" \
  "default:the layer guide's example, default features (tls)" \
  "least:the layer guide's example, no default features" \
  "all:the layer guide's example, tls + cluster + sentinel"; do
  name="${row%%:*}"
  stripped="-"
  if command -v strip >/dev/null 2>&1; then
    strip -o "$work/$name.stripped" "$work/$name"
    stripped="$(mib "$(wc -c <"$work/$name.stripped")")"
  fi
  printf '%-58s %12s %12s\n' "${row#*:}" "$(mib "$(wc -c <"$work/$name")")" "$stripped"
done
