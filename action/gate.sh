#!/usr/bin/env bash
# stagetool's CI step (action.yml runs it; it runs anywhere: no GitHub needed).
#
#   STAGETOOL_COMMAND=check|snapshot  (default check)
#   STAGETOOL_SPEC=stagetool.yaml  STAGETOOL_BASELINE=stagetool.lock.json
#   STAGETOOL_OUTPUT_DIR=stagetool-report   the HTML report (and JUnit XML for check) go here
#   STAGETOOL_ARGS="--isolate --jobs 2"     more options for the stagetool command
#   STAGETOOL="python -m stagetool"         how to run stagetool
#   GITHUB_STEP_SUMMARY                     the Markdown summary is appended there; when unset,
#                                           to $STAGETOOL_OUTPUT_DIR/summary.md
#
# check: compare with the baseline; the HTML page of the changes, the JUnit XML and the Markdown
# summary. snapshot: write the baseline; the HTML report and its Markdown summary.
# Exit status: stagetool's (0 clean, 1 regression, 2 bad input, 3 a function failed to stage).
set -u
command=${STAGETOOL_COMMAND:-check}
spec=${STAGETOOL_SPEC:-stagetool.yaml}
baseline=${STAGETOOL_BASELINE:-stagetool.lock.json}
out=${STAGETOOL_OUTPUT_DIR:-stagetool-report}
read -r -a stagetool <<< "${STAGETOOL:-python -m stagetool}"
read -r -a extra <<< "${STAGETOOL_ARGS:-}"
mkdir -p "$out" || exit 2
export GITHUB_STEP_SUMMARY=${GITHUB_STEP_SUMMARY:-$out/summary.md}

case "$command" in
  check)
    # stagetool appends the Markdown summary to GITHUB_STEP_SUMMARY itself
    "${stagetool[@]}" check --spec "$spec" --baseline "$baseline" --format html --output "$out/stagetool-check.html" \
      --junit-xml "$out/stagetool-junit.xml" "${extra[@]}"
    code=$?
    ;;
  snapshot)
    "${stagetool[@]}" snapshot --spec "$spec" --output "$baseline" "${extra[@]}"
    code=$?
    if [ "$code" -eq 0 ]; then
      "${stagetool[@]}" report --spec "$spec" --format html --output "$out/stagetool-report.html" || code=$?
      # to stdout: no SVG files linked (a job summary cannot show them; the HTML report has the pictures)
      "${stagetool[@]}" report --spec "$spec" --format markdown > "$out/stagetool-report.md" || code=$?
      if [ -f "$out/stagetool-report.md" ]; then
        { echo "## stagetool snapshot: $baseline"; echo; cat "$out/stagetool-report.md"; } >> "$GITHUB_STEP_SUMMARY"
      fi
    fi
    ;;
  *)
    echo "stagetool gate: STAGETOOL_COMMAND must be check or snapshot, not '$command'" >&2
    exit 2
    ;;
esac
echo "stagetool $command: exit $code; report in $out/, summary in $GITHUB_STEP_SUMMARY" >&2
exit "$code"
