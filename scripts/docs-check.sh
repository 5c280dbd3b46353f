#!/usr/bin/env bash
# CI: the docs and comments name only what exists. Fails on
#   - a repository path (src/..., include/..., apps/..., tests/..., scripts/..., cmake/...,
#     docs/..., slurm/..., .ci/...) named in a comment of a .cpp/.hpp/.h/.cu/.cuh/.cmake/
#     .sh/.sbatch or CMakeLists.txt file, or anywhere in the Markdown docs (README.md,
#     CONTRIBUTING.md, docs/*.md, slurm/README.md), that is not in the tree. A path may
#     end in :LINE, :LINE-LINE or #anchor, hold globs (src/worker/*.cpp) or one brace
#     list (src/control/{mpi,memory}_transport.cpp); a module-relative file
#     (worker/monitor.hpp) is looked for under src/, a public header as included
#     (meshrt/group.hpp) under include/; URLs and build outputs (build/..., build-*/...) are
#     skipped because they do not start with a repository folder;
#   - a section of docs/ARCHITECTURE.md that does not exist: "ARCHITECTURE.md section N",
#     "ARCHITECTURE §N" and, on a line that names ARCHITECTURE or in ARCHITECTURE.md
#     itself, "section N" and "sections N and M" (its sections are its "## N." and
#     "### N.M" headings);
#   - a Markdown link to a file that does not exist, or to an #anchor that none of the
#     target's headings makes (GitHub's rule: lower case, punctuation dropped, spaces to -);
#   - a Markdown code block left open (it would hide the rest of the file's links).
# Reads tracked sources only (no build), in about a second; scripts/test.sh runs it
# beside scripts/format-check.sh and scripts/include-check.sh.
source "$(dirname "$0")/common.sh"
cd "$MESHRT_ROOT"

if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "docs-check: expected a git checkout (the check covers tracked files), found none at $MESHRT_ROOT" >&2
  exit 1
fi
# Files that exist only in a build folder but are named by their installed path.
generated=(include/meshrt/config.hpp)

mapfile -t tracked < <(git ls-files)
declare -A exists=()
for f in "${tracked[@]}" "${generated[@]}"; do
  exists[$f]=1
  d=$f
  while [[ "$d" == */* ]]; do
    d=${d%/*}
    [ -n "${exists[$d/]:-}" ] && break
    exists[$d/]=1
  done
done
mapfile -t sources < <(printf '%s\n' "${tracked[@]}" |
  grep -E '(\.(cpp|hpp|h|cc|cu|cuh|cmake|sh|sbatch|py|pyi)|(^|/)CMakeLists\.txt)$' |
  grep -vE '^docs/|\.md$' || true)
mapfile -t markdown < <(printf '%s\n' "${tracked[@]}" |
  grep -E '^(README\.md|CONTRIBUTING\.md|docs/[^/]*\.md|slurm/README\.md)$' || true)
for f in "${sources[@]}" "${markdown[@]}"; do [ -f "$f" ] || { echo "docs-check: $f is tracked but missing" >&2; exit 1; }; done

# One awk pass over every file prints what to check, one item a line:
#   P <file:line> <path>       a repository path
#   S <file:line> <section>    an ARCHITECTURE.md section
#   L <file:line> <target>     a Markdown link (relative to the file's folder)
#   A <file> <anchor>          an anchor a Markdown file's headings make
#   F <file:line> -            a code block opened there and never closed
#   D <file:line> -            a citation of DESIGN, a document users do not have
# shellcheck disable=SC2016
items=$(awk -v nsrc="${#sources[@]}" '
  function paths(text, where,   t, p) {
    gsub(/[a-z]+:\/\/[^ \t)>`"]*/, " ", text)  # URLs
    t = " " text
    while (match(t, /[^A-Za-z0-9_.\/~$-](src|include|apps|tests|scripts|cmake|docs|slurm|python|\.ci)\/[A-Za-z0-9_.\/*?{},:#+-]*/)) {
      p = substr(t, RSTART + 1, RLENGTH - 1)
      t = substr(t, RSTART + RLENGTH)
      print "P", where, p
    }
    # Module-relative files ("worker/monitor.hpp" means src/worker/monitor.hpp) and public
    # headers as included ("meshrt/group.hpp" means include/meshrt/group.hpp).
    t = " " text
    while (where !~ /^python\/src\// && match(t, /[^A-Za-z0-9_.\/~$-](common|settings|log|ndslice|tensor|value|device|protocol|functions|comm|control|worker|controller|runtime|group|testing|meshrt)\/[A-Za-z0-9_\/]*\.(hpp|cpp|cu|h)/)) {
      p = substr(t, RSTART + 1, RLENGTH - 1)
      t = substr(t, RSTART + RLENGTH)
      print "P", where, (p ~ /^meshrt\// ? "include/" : "src/") p
    }
    # The folders of the Python binding (api, support, group), named from inside it.
    if (where ~ /^python\/src\//) {
      t = " " text
      while (match(t, /[^A-Za-z0-9_.\/~$-](api|support|group)\/[A-Za-z0-9_\/]*\.(hpp|cpp)/)) {
        p = substr(t, RSTART + 1, RLENGTH - 1)
        t = substr(t, RSTART + RLENGTH)
        print "P", where, "python/src/" p
      }
    }
  }
  function design(text, where) {
    if (text ~ /DESIGN(\.md)?[`,]*( |\n)*(section|§)/ || text ~ /DESIGN\.md/) print "D", where, "-"
  }
  function sections(text, where,   t, s, n) {
    t = text
    # "ARCHITECTURE.md section 3.5", "ARCHITECTURE §8.1", "ARCHITECTURE.md, section 2"
    while (match(t, /ARCHITECTURE(\.md)?[`,]*( |\n)*(section|§) ?[0-9]+(\.[0-9]+)*/)) {
      s = substr(t, RSTART, RLENGTH); t = substr(t, RSTART + RLENGTH)
      sub(/^.*(section|§) ?/, "", s); print "S", where, s
    }
    if (FILENAME ~ /ARCHITECTURE\.md$/ || text ~ /ARCHITECTURE/) {
      t = text
      while (match(t, /[Ss]ections? [0-9]+(\.[0-9]+)*((,| and| or) [0-9]+(\.[0-9]+)*)*/)) {
        s = substr(t, RSTART, RLENGTH); t = substr(t, RSTART + RLENGTH)
        sub(/^[Ss]ections? /, "", s); gsub(/,| and| or/, " ", s)
        n = split(s, parts, / +/)
        for (i = 1; i <= n; i++) if (parts[i] != "") print "S", where, parts[i]
      }
    }
  }
  function anchor(h,   a) {
    a = tolower(h)
    gsub(/[^a-z0-9 _-]/, "", a)
    gsub(/ /, "-", a)
    return a
  }
  function unclosed() { if (fence) print "F", prev ":" fenceline, "-" }
  FNR == 1 { unclosed(); fileno++; inblock = 0; fence = 0; prev = FILENAME }
  END { unclosed() }
  {
    where = FILENAME ":" FNR
    line = $0
    if (fileno <= nsrc) {
      if (FILENAME ~ /\.(sh|sbatch|cmake)$/ || FILENAME ~ /CMakeLists\.txt$/) {
        if (match(line, /(^|[ \t])#[^!{#]/)) { c = substr(line, RSTART); paths(c, where); sections(c, where); design(c, where) }
        next
      }
      # Python: comments and docstrings are prose alike, so every line is read.
      if (FILENAME ~ /\.pyi?$/) { paths(line, where); sections(line, where); design(line, where); next }
      c = ""
      if (inblock) {
        if ((e = index(line, "*/")) > 0) { c = substr(line, 1, e - 1); inblock = 0 } else c = line
      } else if ((s = index(line, "/*")) > 0 && (index(line, "//") == 0 || s < index(line, "//"))) {
        rest = substr(line, s + 2)
        if ((e = index(rest, "*/")) > 0) c = substr(rest, 1, e - 1); else { c = rest; inblock = 1 }
      } else if (match(line, /(^|[^:])\/\//)) {
        c = substr(line, RSTART + RLENGTH)
      }
      if (c != "") { paths(c, where); sections(c, where); design(c, where) }
      next
    }
    # Markdown
    if (line ~ /^[ \t]*```/) { fence = !fence; fenceline = FNR }
    if (!fence && line ~ /^#+ /) {
      h = line; sub(/^#+ +/, "", h)
      a = anchor(h); seen[FILENAME, a]++
      print "A", FILENAME, (seen[FILENAME, a] > 1 ? a "-" (seen[FILENAME, a] - 1) : a)
    }
    paths(line, where); sections(line, where); design(line, where)
    if (!fence) {
      t = line
      while (match(t, /\]\([^) \t]+\)/)) {
        l = substr(t, RSTART + 2, RLENGTH - 3); t = substr(t, RSTART + RLENGTH)
        if (l !~ /^[a-z]+:/) print "L", where, l
      }
    }
  }
' "${sources[@]}" "${markdown[@]}")

# The sections of docs/ARCHITECTURE.md: "## 3. Title" -> 3, "### 3.5 Title" -> 3.5.
declare -A section=()
while read -r n; do section[$n]=1; done < <(sed -nE 's/^#{2,4} ([0-9]+(\.[0-9]+)*)\.? .*/\1/p' docs/ARCHITECTURE.md)
declare -A anchors=()
while read -r kind file a; do [ "$kind" = A ] && anchors["$file#$a"]=1; done <<<"$items"

# A path exists: a tracked file, a folder holding one, a glob or one brace list matching one.
declare -A verdict=()
path_exists() {
  local p=$1 f pre alt post IFS
  if [[ "$p" =~ ^([^{]*)\{([^}]*)\}(.*)$ ]]; then
    pre=${BASH_REMATCH[1]} post=${BASH_REMATCH[3]}
    IFS=, read -ra alts <<<"${BASH_REMATCH[2]}"
    for alt in "${alts[@]}"; do path_exists "$pre$alt$post" || return 1; done
    return 0
  fi
  if [[ "$p" == *[*?]* ]]; then
    for f in "${tracked[@]}"; do
      # shellcheck disable=SC2053
      [[ "$f" == $p || "$f/" == $p* ]] && return 0
    done
    return 1
  fi
  [ -n "${exists[$p]:-}" ] || [ -n "${exists[$p/]:-}" ]
}

errors=()
declare -A reported=()
paths_checked=0 sections_checked=0 links_checked=0
while read -r kind where what; do
  case "$kind" in
    P)
      p=$what
      p=${p%%#*}                            # #anchor
      p=$(sed -E 's/(:[0-9]+(-[0-9]+)?)?[.,:;]*$//' <<<"$p")  # :LINE, :LINE-LINE, punctuation
      [ -n "$p" ] || continue
      [[ "$p" =~ /[a-z]\.[a-z]+$ ]] && continue  # a placeholder: "x/y.hpp", "src/control/a.cpp"
      paths_checked=$((paths_checked + 1))
      if [ -z "${verdict[$p]:-}" ]; then
        if path_exists "$p"; then verdict[$p]=ok; else verdict[$p]=missing; fi
      fi
      if [ "${verdict[$p]}" != ok ] && [ -z "${reported["$where $p"]:-}" ]; then
        reported["$where $p"]=1
        errors+=("$where: names $p, which is not in the tree")
      fi
      ;;
    S)
      sections_checked=$((sections_checked + 1))
      [ -n "${reported["$where section $what"]:-}" ] && continue
      reported["$where section $what"]=1
      [ -n "${section[$what]:-}" ] ||
        errors+=("$where: names docs/ARCHITECTURE.md section $what; its sections are $(printf '%s\n' "${!section[@]}" | sort -V | tr '\n' ' ')")
      ;;
    F)
      errors+=("$where: opens a \`\`\` code block that the file never closes")
      ;;
    D)
      errors+=("$where: cites DESIGN, a document users do not have: expected docs/ARCHITECTURE.md (and its section) or a user doc")
      ;;
    L)
      links_checked=$((links_checked + 1))
      file=${where%:*}
      target=${what%%#*}
      a=""
      [[ "$what" == *#* ]] && a=${what#*#}
      if [ -z "$target" ]; then
        resolved=$file
      else
        resolved=$(realpath -m --relative-to=. "$(dirname "$file")/$target")
      fi
      if [ -z "${exists[$resolved]:-}" ] && [ -z "${exists[$resolved/]:-}" ]; then
        [ -n "${reported["$where $resolved"]:-}" ] && continue
        reported["$where $resolved"]=1
        errors+=("$where: links to $what, but $resolved is not in the tree")
      elif [ -n "$a" ] && [[ "$resolved" == *.md ]] && [ -z "${anchors["$resolved#$a"]:-}" ]; then
        errors+=("$where: links to $what, but no heading of $resolved makes the anchor #$a")
      fi
      ;;
  esac
done <<<"$items"

if [ ${#errors[@]} -gt 0 ]; then
  printf 'docs-check: %s\n' "${errors[@]}" >&2
  echo "docs-check: ${#errors[@]} reference(s) to a missing path, section or anchor" >&2
  exit 1
fi
echo "docs-check: $paths_checked paths, $sections_checked ARCHITECTURE.md sections and $links_checked links in ${#sources[@]} sources and ${#markdown[@]} docs exist"
