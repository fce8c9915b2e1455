# The supervisor of one process-runtime attempt where supervise.c cannot be built (agents/runtime/
# process.py explains the design; both write the same records):
#
#   bash -p supervise.sh <attempt-dir> <lease.deadline> <lease.json> <started-fd> -- command...
#
# Only bash builtins run here: the job is the one process this script starts. It checks the
# node's lease, starts the job in a process group of its own, writes the job's pid to
# `child.json` (the form the former Python supervisor wrote, which every fence reads),
# closes <started-fd> (the agent waits for that), waits, and writes the exit code to `exit` the
# way a shell reports it (128 + signal). Each record is one line written by one printf (a single
# write); the agent takes a line without its newline for one not written yet.
#
# Until the job is forked every variable is named _gpucp_*: the job's environment is this
# shell's, and assigning a name it holds (say `dir`) would change that variable for the job.

_gpucp_dir=$1 _gpucp_deadline=$2 _gpucp_lease=$3 _gpucp_started_fd=$4
shift 4
[ "$1" = -- ] && shift

_gpucp_now() {  # Unix time in _gpucp_time (EPOCHREALTIME has the locale's decimal point)
	_gpucp_time=$EPOCHREALTIME
	_gpucp_time=${_gpucp_time%[!0-9]*}.${_gpucp_time#*[!0-9]}
}

finish() {  # kind, message: a record for a job that never ran
	printf 'gpucp: not started: %s\n' "$2" >&2
	_gpucp_now
	printf '%s %s %s\n' "$1" "$_gpucp_time" "$2" >"$_gpucp_dir/exit"
	exit 0
}

# Checked once more right before the job starts: an agent paused between deciding to start it
# and starting it may wake after the lease ran out, when the control plane may have given the
# GPUs to someone else; this process was not paused. The agent writes the lease's end here in
# centiseconds of CLOCK_BOOTTIME, which /proc/uptime counts (suspend included).
if [ -e "$_gpucp_deadline" ]; then
	{
		read -r _gpucp_boot _gpucp_kill_cs _gpucp_grace_cs
		while read -r _gpucp_attempt _gpucp_attempt_grace_cs; do
			[ "$_gpucp_attempt" = "$GPUCP_ATTEMPT_ID" ] && _gpucp_grace_cs=$_gpucp_attempt_grace_cs
		done
	} <"$_gpucp_deadline"
	read -r _gpucp_this_boot </proc/sys/kernel/random/boot_id
	read -r _gpucp_uptime _ </proc/uptime
	for _gpucp_number in "$_gpucp_kill_cs" "$_gpucp_grace_cs"; do
		case $_gpucp_number in
		'' | *[!0-9]*) finish refused "the node's lease file cannot be read" ;;
		esac
	done
	if [ "$_gpucp_boot" != "$_gpucp_this_boot" ]; then
		finish refused "the node's lease is from before a reboot"
	fi
	# /proc/uptime truncates to centiseconds: refusing from the centisecond that holds the
	# deadline never starts a job at or after it.
	if ((10#${_gpucp_uptime%.*}${_gpucp_uptime#*.} >= 10#$_gpucp_kill_cs - 10#$_gpucp_grace_cs)); then
		finish refused "the node's lease ran out before the job could start"
	fi
elif [ -e "$_gpucp_lease" ]; then
	finish refused "the node's lease file cannot be read"
fi

# A command that is not there never starts (one that cannot run for another reason, say a bad
# interpreter, exits 126 or 127 as in a shell, with bash's reason in the log).
if ! type -P -- "$1" >/dev/null; then
	printf -v _gpucp_reason 'cannot run %q: not found' "$1"
	finish failed "$_gpucp_reason"
fi

# Stop signals are for the job's group; the supervisor must live on to record the exit. Until
# the job is forked they are trapped (a trap, unlike an ignore, is reset to the default in the
# job); from then on ignored, so that none can cut the `wait` short.
trap : TERM INT HUP
# Job control: the job gets a process group of its own, made by this shell before it goes on,
# so that the group exists by the time the agent reads the job's pid. The subshell resets the
# traps before it closes its copy of <started-fd>, and the agent waits for every copy to close:
# by then a stop signal reaches the job with its default action.
set -m
(exec "$@" {_gpucp_started_fd}>&-) &
job=$!
# Stops of the job (SIGSTOP, SIGTSTP) are not its end: without job control `wait` sees none.
set +m
trap '' TERM INT HUP

# The job's start time, so that a reused pid is never taken for it. A job already reaped (it
# ended at once) or a pid that is no longer our child gets none: nothing of it to signal.
pid=null ticks=null
if read -r stat 2>/dev/null <"/proc/$job/stat"; then
	set -f
	set -- ${stat##*) }
	[ "$2" = $$ ] && pid=$job ticks=${20}
fi
_gpucp_now
printf '{"pid": %s, "start_ticks": %s, "started_at": %s}\n' "$pid" "$ticks" "$_gpucp_time" \
	>"$_gpucp_dir/child.json"
exec {_gpucp_started_fd}>&-

wait "$job"
status=$?
_gpucp_now
printf 'exit %s %s\n' "$status" "$_gpucp_time" >"$_gpucp_dir/exit"
