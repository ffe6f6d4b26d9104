#!/usr/bin/env bash
# Scripted terminal check of `minids chat` under tmux: a real pseudo-terminal, so libedit's line
# editing, the prompt, Ctrl-C and Ctrl-D are exercised the way a person would use them.
#
# usage: scripts/check_chat_tty.sh [BUILD_DIR] [MODEL.mds]
#   BUILD_DIR defaults to ./build; MODEL defaults to tiny-v2-lite converted into a temp dir.
# Prints each step's screen and exits non-zero on the first failed check.
set -euo pipefail

build=${1:-build}
minids="$build/minids"
[[ -x $minids ]] || { echo "no $minids: build first" >&2; exit 2; }
command -v tmux >/dev/null || { echo "tmux is not installed" >&2; exit 2; }

work=$(mktemp -d)
session="minids-chat-check-$$"
cleanup() { tmux kill-session -t "$session" 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

model=${2:-}
if [[ -z $model ]]; then
    model="$work/tiny.mds"
    "$minids" convert tests/data/tiny-v2-lite -o "$model" --expert-dtype bf16 2>/dev/null
fi

screen() { tmux capture-pane -p -t "$session"; }
# Waits until the pane shows $1 (a grep -E pattern), at most ~20 s.
wait_for() {
    for _ in $(seq 200); do
        if screen | grep -Eq -- "$1"; then return 0; fi
        sleep 0.1
    done
    echo "FAIL: waited for '$1'; the screen was:" >&2
    screen >&2
    exit 1
}
step() { echo "== $1"; screen | sed '/^$/d' | tail -n 12; }

# The exit status is written where the test can read it once the pane's shell is gone.
tmux new-session -d -s "$session" -x 120 -y 40 \
    "$minids chat -m '$model' --temp 0 -n 8 -t 2; echo \$? > '$work/status'; sleep 30"
wait_for '^>( |$)'
step "prompt shown"

# Line editing: type, move left over a typo with the arrow keys and fix it.
tmux send-keys -t "$session" "Hello thxre" Left Left BSpace "e" Enter
wait_for 'answer [0-9]+ tokens'
step "first answer (typed 'Hello thxre', fixed to 'Hello there' with Left/BSpace)"

# History: Up brings back the previous line.
tmux send-keys -t "$session" Up
wait_for '> Hello there$'
tmux send-keys -t "$session" C-u
step "Up recalled the last line"

# Multi-line input with a trailing backslash, then a second turn that reuses the cache.
tmux send-keys -t "$session" 'Tell me \' Enter
wait_for '^\.\.\.'
tmux send-keys -t "$session" 'more' Enter
wait_for '\(([1-9][0-9]*) reused\)'
step "second turn (continuation prompt, cache reused)"

tmux send-keys -t "$session" "/clear" Enter
wait_for 'conversation cleared'
step "/clear"

# Ctrl-D at an empty prompt ends the chat with status 0.
tmux send-keys -t "$session" C-d
for _ in $(seq 100); do [[ -s $work/status ]] && break; sleep 0.1; done
status=$(cat "$work/status" 2>/dev/null || echo none)
echo "== Ctrl-D: exit status $status"
[[ $status == 0 ]] || { echo "FAIL: expected 0" >&2; exit 1; }

# Ctrl-C at the prompt exits with 130.
rm -f "$work/status"
tmux kill-session -t "$session"
tmux new-session -d -s "$session" -x 120 -y 40 \
    "$minids chat -m '$model' --temp 0 -c 30000 -n 20000 -t 2; echo \$? > '$work/status'; sleep 30"
wait_for '^>( |$)'
# A long answer (20000 tokens would take many seconds) interrupted by one Ctrl-C: back at the prompt.
tmux send-keys -t "$session" "Write a long story" Enter
sleep 0.3
tmux send-keys -t "$session" C-c
wait_for 'interrupted|answer [0-9]+ tokens'
wait_for '^> ?$'
step "one Ctrl-C during the answer: the answer stops, the prompt is back"
[[ ! -s $work/status ]] || { echo "FAIL: the first Ctrl-C ended the program" >&2; exit 1; }
tmux send-keys -t "$session" C-c
for _ in $(seq 100); do [[ -s $work/status ]] && break; sleep 0.1; done
status=$(cat "$work/status" 2>/dev/null || echo none)
echo "== Ctrl-C at the prompt: exit status $status"
[[ $status == 130 ]] || { echo "FAIL: expected 130" >&2; exit 1; }
echo "PASS: chat under a terminal"
