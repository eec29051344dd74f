#!/usr/bin/env bash
# Follows each framework guide's "Try it on CPU" block in a fresh virtualenv, exactly as written,
# and prints a table: framework | install seconds | venv size | command | seconds | result.
#
#   bash scripts/guides_fresh_venv.sh [verl] [skyrl] [areal]     # default: all three, one after another
#   bash scripts/guides_fresh_venv.sh --print [FRAMEWORK...]      # only print the driver each would run
#
# Not part of `make test` (each framework takes minutes to install); tests/adapters/test_guide_commands.py
# checks that every guide has its block and that the block says what this script runs. The block is
# the ```bash fence after the line `<!-- fresh-venv: FRAMEWORK -->` in docs/use-with-FRAMEWORK.md. Its
# first line names the checkout and the virtualenv (R3BRIDGE=..., VENV=...): here R3BRIDGE is this
# checkout and VENV a new folder under a temporary directory; every other line runs as written, in
# one bash, in order, each timed. Lines before the one running testlab/cpu_step.py count as install.
#
# Nothing is reused but pip's download cache (as CI does). The machine's own pip configuration
# applies (its index, find-links and constraints). If download.pytorch.org cannot be reached, a
# torch line runs without its `--index-url https://download.pytorch.org/whl/cpu` and with torch
# pinned as `torch==X+cpu` (the table says so): pip takes the CPU build from the configured index
# and find-links if they have it, and stops otherwise, as the block's guard would for a user.
#
# Replay counts as on when the run's output has the adapter's startup line with the mode and where
# it came from (`replay_mode=R3 (from config)`), an `r3bridge/` metric the framework returned, and
# cpu_step's `OK` (every router call dispatched the routes it had to).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PRINT=0
[ "${1:-}" = "--print" ] && { PRINT=1; shift; }
FRAMEWORKS=("$@")
[ ${#FRAMEWORKS[@]} -eq 0 ] && FRAMEWORKS=(verl skyrl areal)
TORCH_CPU_INDEX="https://download.pytorch.org/whl/cpu"

# the block after the marker, from its ```bash fence to the closing fence
block() {
    awk -v marker="<!-- fresh-venv: $1 -->" '
        $0 == marker { found = 1; next }
        found == 1 && /^```bash/ { found = 2; next }
        found == 2 && /^```/ { exit }
        found == 2 { print }' "$ROOT/docs/use-with-$1.md"
}

# the driver for one block: its lines after the first, in one bash, in order, each followed by its
# timing record; R3BRIDGE is this checkout and VENV the folder's venv (the block's first line names them)
driver() {
    local dir="$1"; shift
    echo "set -u"
    echo "unset PYTHONPATH VIRTUAL_ENV R3BRIDGE_CONFIG R3BRIDGE_REPLAY_MODE"
    echo "R3BRIDGE='$ROOT'; VENV='$dir/venv'; export HOME='$HOME'"
    echo "cd '$dir/elsewhere'"
    local line run q
    for line in "$@"; do
        run="$line"
        if [ "$TORCH_INDEX_OK" = 0 ] && [[ "$line" == *"pip install torch"*"--index-url $TORCH_CPU_INDEX"* ]]; then
            # the configured index instead, for the CPU build only (torch==X+cpu): never the CUDA one
            run=$(sed -E "s# --index-url $TORCH_CPU_INDEX##; s#(^| )torch==([0-9.]+)( |\$)#\\1torch==\\2+cpu\\3#" <<<"$line")
        fi
        q=$(printf '%q' "$line")
        echo "__t0=\$(date +%s%N); echo \"+ \"$q"
        echo "$run"
        echo "__rc=\$?; __ms=\$(( (\$(date +%s%N) - __t0) / 1000000 )); echo \"TIMING \$__rc \$((__ms / 1000)).\$(printf %03d \$((__ms % 1000))) \"$q; [ \$__rc -eq 0 ] || exit \$__rc"
    done
}

lines_of() {
    mapfile -t LINES < <(block "$1")
    if [ ${#LINES[@]} -eq 0 ]; then echo "no fresh-venv block for $1 in docs/use-with-$1.md"; exit 2; fi
    case "${LINES[0]}" in R3BRIDGE=*VENV=*) ;; *) echo "$1: first line must set R3BRIDGE and VENV: ${LINES[0]}"; exit 2;; esac
}

if [ "$PRINT" = 1 ]; then      # what each block becomes, as written
    TORCH_INDEX_OK=${TORCH_INDEX_OK:-1}       # TORCH_INDEX_OK=0: as when download.pytorch.org is unreachable
    for fw in "${FRAMEWORKS[@]}"; do
        lines_of "$fw"
        echo "## $fw"
        driver "/tmp/r3bridge-guides-XXXXXX/$fw" "${LINES[@]:1}"
    done
    exit 0
fi

WORK="$(mktemp -d /tmp/r3bridge-guides-XXXXXX)"
if curl -s -o /dev/null --max-time 10 "$TORCH_CPU_INDEX/"; then TORCH_INDEX_OK=1; else TORCH_INDEX_OK=0; fi
PYV="$(python3 -V 2>&1)"
echo "guides_fresh_venv: checkout $ROOT, work folder $WORK, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) CPUs," \
     "load $(cut -d' ' -f1-3 /proc/loadavg), $PYV, download.pytorch.org reachable: $TORCH_INDEX_OK"

ROWS=()
for fw in "${FRAMEWORKS[@]}"; do
    lines_of "$fw"
    dir="$WORK/$fw"
    mkdir -p "$dir/elsewhere"
    log="$dir/log"
    note=""
    driver "$dir" "${LINES[@]:1}" > "$dir/driver.sh"
    if [ "$TORCH_INDEX_OK" = 0 ] && printf '%s\n' "${LINES[@]}" | grep -q -- "--index-url $TORCH_CPU_INDEX"; then
        note="download.pytorch.org unreachable: torch==X+cpu from the configured index"
    fi
    echo "== $fw: $(( ${#LINES[@]} - 1 )) lines from docs/use-with-$fw.md, log $log"
    bash "$dir/driver.sh" > "$log" 2>&1
    rc=$?
    install_s=$(awk '$1 == "TIMING" && $0 !~ /cpu_step.py/ { s += $3 } END { printf "%.0f", s }' "$log")
    run_line=$(awk '$1 == "TIMING" && /cpu_step.py/' "$log" | tail -1)
    run_s=$(echo "$run_line" | awk '{ printf "%.0f", $3 }')
    size=$(du -sh "$dir/venv" 2>/dev/null | cut -f1)
    torch_v=$("$dir/venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null)
    [ -n "$torch_v" ] && note="torch $torch_v${note:+; $note}"
    # the CPU step's first line names where r3bridge was imported from
    where=$(grep -m1 -oE "r3bridge [0-9.]+ from [^ ]+" "$log" | awk '{ print $4 }')
    case "$where" in "$dir/venv/"*site-packages*) note="${note:+$note; }r3bridge installed, not editable";;
                     "") ;; *) note="${note:+$note; }r3bridge imported from $where";; esac
    cmd=$(printf '%s\n' "${LINES[@]}" | grep cpu_step.py | tail -1)
    if [ $rc -ne 0 ]; then
        result="FAILED (exit $rc at: $(grep '^TIMING' "$log" | tail -1 | cut -d' ' -f4-))"
        [ -z "$run_line" ] && result="FAILED (exit $rc during install: $(grep '^+ ' "$log" | tail -1 | cut -c3-))"
        pip_error=$(grep -m1 '^ERROR: ' "$log")
        [ -n "$pip_error" ] && result="$result: $pip_error"
    else
        startup=$(grep -m1 -oE "r3bridge \([^)]*\): replay_mode=(R3|R2) \(from [^)]*\)+" "$log")
        # what the framework returned: the mode code (3 = R3, 2 = R2) and the update's coverage
        metric=$(grep -m1 -oE "[a-z_/]*r3bridge/replay_mode=(\[[^]]*\]|[0-9.e+-]+)" "$log")
        coverage=$(grep -m1 -oE "[a-z_/]*r3bridge/update/coverage=(\[[^]]*\]|[0-9.e+-]+)" "$log")
        [ -n "$coverage" ] && metric="$metric, $coverage"
        if [ -n "$startup" ] && [ -n "$metric" ] && grep -q "^cpu_step: OK" "$log"; then
            result="replay on: '${startup#*: }', $metric, $(grep -m1 -oE '[0-9]+ \(token, layer\) pairs checked' "$log" | cut -d' ' -f1) pairs checked, 0 mismatching"
        else
            result="NOT SHOWN (startup line: ${startup:-none}; metric: ${metric:-none})"
        fi
    fi
    echo "   $fw: install ${install_s} s (${note}), venv $size, run ${run_s:-?} s: $result"
    ROWS+=("| $fw | ${install_s} (${note}) | $size | \`${cmd}\` | ${run_s:--} | $result |")
done

echo
echo "| framework | install seconds | venv size | command | seconds | result |"
echo "|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
echo
echo "logs: $WORK/*/log (the virtualenvs are left there: rm -r $WORK)"
