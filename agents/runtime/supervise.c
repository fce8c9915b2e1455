/*
 * The compiled supervisor of one process-runtime attempt: the same contract as supervise.sh
 * (agents/runtime/process.py explains the design), at the cost of a fork and an exec of a
 * small program instead of a bash start. The agent builds it with the host's C compiler
 * (agents/runtime/supervisor.py) and runs supervise.sh where it cannot.
 *
 *   supervise <attempt-dir> <lease.deadline> <lease.json> <started-fd> -- command...
 *   supervise --serve <socket-fd>
 *
 * It checks the node's lease, starts the job in a process group of its own, writes the job's
 * pid to `child.json`, closes <started-fd> (the agent waits for that), waits, and writes the
 * exit code to `exit` the way a shell reports it (128 + signal). Each record is one line made
 * by one write(); the agent takes a line without its newline for one not written yet. Both
 * supervisors write the same records, so an agent of either kind adopts the other's attempts.
 *
 * With --serve it is the agent's fork server: it runs as long as the agent, and for each
 * attempt forks a copy of itself that becomes that attempt's supervisor, exactly as one started
 * with the arguments above (serve() below says how). An exec costs every job the C library's
 * start, which asks the CPU what it is dozens of times; in a virtual machine each such question
 * is a trip to the hypervisor, and the whole came to about 0.6 ms of CPU, where a fork of this
 * small process costs about 0.05 ms.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *attempt_dir;

/* Unix time with microseconds, the form supervise.sh writes. */
static void now(char *out, size_t size) {
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	snprintf(out, size, "%lld.%06ld", (long long)ts.tv_sec, ts.tv_nsec / 1000);
}

/* The whole of `text` to `name` in the attempt's folder, with one write: a reader sees the
 * line whole or not at all (a short write can only cut it, and a cut line has no newline). */
static int write_record(const char *name, const char *text) {
	char path[PATH_MAX];
	if (snprintf(path, sizeof path, "%s/%s", attempt_dir, name) >= (int)sizeof path)
		return -1;
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
	if (fd < 0)
		return -1;
	size_t length = strlen(text);
	ssize_t written;
	do
		written = write(fd, text, length);
	while (written < 0 && errno == EINTR);
	close(fd);
	return written == (ssize_t)length ? 0 : -1;
}

/* A record for a job that never ran ("refused": fenced by the lease; "failed": it could not
 * start), and the supervisor's end. */
static void finish(const char *kind, const char *message) {
	char time_s[32], line[PATH_MAX + 256];
	fprintf(stderr, "gpucp: not started: %s\n", message);
	now(time_s, sizeof time_s);
	snprintf(line, sizeof line, "%s %s %s\n", kind, time_s, message);
	write_record("exit", line);
	exit(0);
}

/* A string of digits as a number; -1 for anything else (empty, a sign, too long). */
static long long digits(const char *text) {
	if (!*text || strlen(text) > 18)
		return -1;
	long long value = 0;
	for (const char *c = text; *c; c++) {
		if (*c < '0' || *c > '9')
			return -1;
		value = value * 10 + (*c - '0');
	}
	return value;
}

/* The first line of a small file, without its newline; -1 when it cannot be read. */
static ssize_t read_small(const char *path, char *buffer, size_t size) {
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t total = 0, got;
	while ((size_t)total < size - 1 && (got = read(fd, buffer + total, size - 1 - total)) != 0) {
		if (got < 0) {
			if (errno == EINTR)
				continue;
			close(fd);
			return -1;
		}
		total += got;
	}
	close(fd);
	buffer[total] = '\0';
	return total;
}

/* Checked once more right before the job starts: an agent paused between deciding to start it
 * and starting it may wake after the lease ran out, when the control plane may have given the
 * GPUs to someone else; this process was not paused. agents.lease writes the lease's end in
 * centiseconds of CLOCK_BOOTTIME (suspend included):
 *   <boot id> <kill at, cs> <grace, cs>
 *   <attempt id> <grace of that attempt, cs>     (any number of these lines)
 */
static char lease_text[1 << 20]; /* a line per running attempt with a grace of its own */

/* The text without the blanks around it, as a shell's `read` leaves its last field. */
static char *trimmed(char *text) {
	if (!text)
		return NULL;
	text += strspn(text, " \t");
	size_t length = strlen(text);
	while (length && (text[length - 1] == ' ' || text[length - 1] == '\t'))
		text[--length] = '\0';
	return text;
}

static void check_lease(const char *deadline_path, const char *lease_path) {
	char *text = lease_text;
	if (read_small(deadline_path, text, sizeof lease_text) < 0) {
		if (errno == ENOENT && access(lease_path, F_OK) != 0)
			return; /* a node without leases */
		finish("refused", "the node's lease file cannot be read");
	}
	/* A last attempt line without its newline is not taken, as a shell's `read` loop takes
	 * none (agents.lease replaces the file whole, so there is none but in a broken one). */
	char *last_newline = strrchr(text, '\n');
	if (last_newline && last_newline[1])
		last_newline[1] = '\0';
	const char *attempt = getenv("GPUCP_ATTEMPT_ID");
	char *save_line = NULL, *line = text[0] == '\n' ? NULL : strtok_r(text, "\n", &save_line);
	char *save = NULL;
	char *boot = line ? strtok_r(line, " \t", &save) : NULL;
	char *kill_cs_text = boot ? strtok_r(NULL, " \t", &save) : NULL;
	char *grace_cs_text = kill_cs_text ? trimmed(strtok_r(NULL, "", &save)) : NULL;
	while (boot && (line = strtok_r(NULL, "\n", &save_line)) != NULL) {
		char *attempt_save = NULL;
		char *id = strtok_r(line, " \t", &attempt_save);
		char *grace = id ? trimmed(strtok_r(NULL, "", &attempt_save)) : NULL;
		if (id && attempt && strcmp(id, attempt) == 0)
			grace_cs_text = grace;
	}
	long long kill_cs = kill_cs_text ? digits(kill_cs_text) : -1;
	long long grace_cs = grace_cs_text ? digits(grace_cs_text) : -1;
	if (kill_cs < 0 || grace_cs < 0)
		finish("refused", "the node's lease file cannot be read");
	char this_boot[64];
	if (read_small("/proc/sys/kernel/random/boot_id", this_boot, sizeof this_boot) < 0)
		finish("refused", "the node's lease file cannot be read");
	this_boot[strcspn(this_boot, "\n")] = '\0';
	if (strcmp(boot, this_boot) != 0)
		finish("refused", "the node's lease is from before a reboot");
	/* Truncated to centiseconds as /proc/uptime is: refusing from the centisecond that holds
	 * the deadline never starts a job at or after it. */
	struct timespec boottime;
	clock_gettime(CLOCK_BOOTTIME, &boottime);
	long long uptime_cs = (long long)boottime.tv_sec * 100 + boottime.tv_nsec / 10000000;
	if (uptime_cs >= kill_cs - grace_cs)
		finish("refused", "the node's lease ran out before the job could start");
}

/* Where `name` runs from, as a shell finds it (`type -P`): itself when it holds a slash, else
 * the first executable regular file of that name on PATH. */
static int find_command(const char *name, char *out, size_t size) {
	struct stat st;
	if (strchr(name, '/')) {
		if (snprintf(out, size, "%s", name) >= (int)size)
			return -1;
		return stat(out, &st) == 0 && S_ISREG(st.st_mode) && access(out, X_OK) == 0 ? 0 : -1;
	}
	if (!*name)
		return -1;
	const char *path = getenv("PATH");
	if (!path)
		path = "/usr/local/bin:/usr/bin:/bin";
	for (const char *start = path;; start++) {
		const char *end = strchrnul(start, ':');
		int length = (int)(end - start);
		/* An empty entry is the current folder, as for a shell. */
		if (snprintf(out, size, "%.*s%s%s", length, start, length ? "/" : "./", name) < (int)size
		    && stat(out, &st) == 0 && S_ISREG(st.st_mode) && access(out, X_OK) == 0)
			return 0;
		if (!*end)
			return -1;
		start = end;
	}
}

/* The name as the log shows it: plain when it is plain, else single-quoted. */
static void quoted(const char *name, char *out, size_t size) {
	if (*name && strspn(name, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
	                          "_-./+,:@%=") == strlen(name)) {
		snprintf(out, size, "%s", name);
		return;
	}
	size_t at = 0;
	out[at++] = '\'';
	for (const char *c = name; *c && at + 6 < size; c++) {
		if (*c == '\'') {
			memcpy(out + at, "'\\''", 4);
			at += 4;
		} else
			out[at++] = *c;
	}
	out[at++] = '\'';
	out[at] = '\0';
}

/* The start time of our own child in clock ticks since boot, field 22 of /proc/<pid>/stat (it
 * is there while the child is unreaped, a zombie included): a reused pid is never taken for
 * the job's. */
static long long start_ticks(pid_t pid) {
	char path[64], stat_text[1024];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	if (read_small(path, stat_text, sizeof stat_text) < 0)
		return -1;
	char *fields = strrchr(stat_text, ')');
	if (!fields)
		return -1;
	char *save = NULL, *field = strtok_r(fields + 1, " ", &save);
	for (int i = 1; field && i < 20; i++) /* fields[0] is the state, fields[19] the start */
		field = strtok_r(NULL, " ", &save);
	return field ? digits(field) : -1;
}

static int supervise(int argc, char **argv) {
	if (argc < 6) {
		fprintf(stderr, "usage: %s <attempt-dir> <lease.deadline> <lease.json> <started-fd> -- "
		                "command...\n", argv[0]);
		return 2;
	}
	attempt_dir = argv[1];
	const char *deadline_path = argv[2], *lease_path = argv[3];
	long long started_fd = digits(argv[4]);
	int first = 5;
	if (strcmp(argv[first], "--") == 0)
		first++;
	if (started_fd < 0 || started_fd > INT_MAX || first >= argc) {
		fprintf(stderr, "%s: a started-fd and a command are needed\n", argv[0]);
		return 2;
	}

	/* Stop signals are for the job's group; the supervisor lives on to record the exit (the
	 * job gets every signal at its default). Ignored, none can cut the wait short. */
	signal(SIGTERM, SIG_IGN);
	signal(SIGINT, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
	/* An ignored SIGCHLD (inherited from whatever started the agent) would have the kernel
	 * reap the job by itself, and waitpid would find no exit code to record. */
	signal(SIGCHLD, SIG_DFL);

	check_lease(deadline_path, lease_path);

	/* A command that is not there never starts (one that cannot run for another reason, say a
	 * bad interpreter, exits 126 or 127 as in a shell, with the reason in the log). */
	char command[PATH_MAX];
	if (find_command(argv[first], command, sizeof command) != 0) {
		char name[512], reason[600];
		quoted(argv[first], name, sizeof name);
		snprintf(reason, sizeof reason, "cannot run %s: not found", name);
		finish("failed", reason);
	}

	/* A reset of every signal the job gets at its default: a handler cannot pass exec, but an
	 * ignore (nohup's SIGHUP, ours above) and a blocked mask would, and a job that ignores
	 * SIGTERM cannot be stopped within its grace. */
	sigset_t all, old;
	sigfillset(&all);
	sigprocmask(SIG_SETMASK, &all, &old);
	pid_t job = fork();
	if (job < 0) {
		char reason[128];
		snprintf(reason, sizeof reason, "cannot start the job: %s", strerror(errno));
		finish("failed", reason);
	}
	if (job == 0) {
		/* The job's own process group, so that a stop reaches everything it spawned and
		 * nothing else. */
		setpgid(0, 0);
		/* Every signal but KILL and STOP, which cannot be caught, and the C library's own two
		 * (32 and 33), which it refuses to change here and sets in the job when it uses them. */
		for (int sig = 1; sig < NSIG; sig++)
			if (sig != SIGKILL && sig != SIGSTOP)
				signal(sig, SIG_DFL);
		sigset_t none;
		sigemptyset(&none);
		sigprocmask(SIG_SETMASK, &none, NULL);
		/* The agent waits for every copy of <started-fd> to close: this one closes once the
		 * signals are the job's. */
		close((int)started_fd);
		execv(command, argv + first);
		if (errno == ENOEXEC) { /* a script without a #! line runs in sh, as from a shell */
			argv[first - 1] = "/bin/sh";
			argv[first] = command;
			execv("/bin/sh", argv + first - 1);
		}
		int failed = errno;
		fprintf(stderr, "gpucp: cannot run %s: %s\n", command, strerror(failed));
		_exit(failed == ENOENT ? 127 : 126); /* a missing #! interpreter too, as bash says */
	}
	/* Made here too: the group exists before the agent reads the job's pid, whichever of the
	 * two runs first (EACCES once the job has exec'd: it made the group itself by then). */
	setpgid(job, job);
	sigprocmask(SIG_SETMASK, &old, NULL);

	char time_s[32], line[256];
	long long ticks = start_ticks(job);
	now(time_s, sizeof time_s);
	if (ticks >= 0)
		snprintf(line, sizeof line, "{\"pid\": %d, \"start_ticks\": %lld, \"started_at\": %s}\n",
		         (int)job, ticks, time_s);
	else
		snprintf(line, sizeof line, "{\"pid\": null, \"start_ticks\": null, \"started_at\": %s}\n",
		         time_s);
	write_record("child.json", line);
	close((int)started_fd);

	/* Stops of the job (SIGSTOP, SIGTSTP) are not its end: without WUNTRACED none is seen. */
	int status;
	while (waitpid(job, &status, 0) < 0)
		if (errno != EINTR) {
			status = 255 << 8;
			break;
		}
	int code = WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
	now(time_s, sizeof time_s);
	snprintf(line, sizeof line, "exit %d %s\n", code, time_s);
	write_record("exit", line);
	return 0;
}


/* --serve: one request per message on the socket (SOCK_SEQPACKET, so each arrives whole), with
 * four descriptors: the started pipe, the job's output, its stdin, and the go pipe. The text is
 * NUL-terminated strings: the work folder, the count of arguments, the arguments as the
 * supervisor takes them (attempt folder first), then the job's environment. The answer is
 * "<pid> <start ticks>\n" of the attempt's supervisor, or "error <reason>\n".
 *
 * The forked supervisor waits for one byte on the go pipe before anything else: the agent sends
 * it once it has recorded the supervisor's pid (record.json). A go pipe closed without it (the
 * agent lost the answer, or died) ends the supervisor before the job could start, so a job
 * never runs that its agent does not know of. The server ends when the agent does (the socket
 * closes); the supervisors it forked live on in sessions of their own, as exec'd ones do. */
#define MAX_REQUEST (1 << 20)
#define REQUEST_FDS 4
static char request[MAX_REQUEST + 1];

static void answer(int sock, const char *text) {
	while (send(sock, text, strlen(text), MSG_NOSIGNAL) < 0 && errno == EINTR)
		;
}

static void reap(void) {
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
}

/* In the forked copy: become the attempt's supervisor. */
static void serve_one(int sock, int fds[REQUEST_FDS], char *text, size_t length) {
	close(sock);
	setsid();
	/* The job's descriptors 0-2 and the started pipe on 3, whatever numbers they came with. */
	int started = fcntl(fds[0], F_DUPFD_CLOEXEC, 10), go = fcntl(fds[3], F_DUPFD_CLOEXEC, 10);
	if (started < 0 || go < 0 || dup2(fds[2], 0) < 0 || dup2(fds[1], 1) < 0 || dup2(fds[1], 2) < 0
	    || dup2(started, 3) < 0)
		_exit(1);
	for (int i = 0; i < REQUEST_FDS; i++)
		if (fds[i] > 3)
			close(fds[i]);
	close(started);
	char byte = 0;
	ssize_t got;
	while ((got = read(go, &byte, 1)) < 0 && errno == EINTR)
		;
	if (got != 1 || byte != 'g')
		_exit(0);
	close(go);
	/* The strings: workdir, argc, argv..., then the environment. */
	char *strings[8192 + 2]; /* MAX_SERVED_STRINGS (process.py), and one spare for the NULL */
	size_t count = 0;
	for (size_t at = 0; at < length && count < sizeof strings / sizeof *strings - 1;) {
		strings[count++] = text + at;
		at += strlen(text + at) + 1;
	}
	long long argc = count > 1 ? digits(strings[1]) : -1;
	if (argc < 6 || (size_t)argc + 2 > count)
		_exit(1);
	char **argv = strings + 2;
	char **env = argv + argc + 1;
	size_t env_count = count - 2 - (size_t)argc;
	/* argv[argc] must be NULL: the environment's first string moves one place on. */
	memmove(env, argv + argc, env_count * sizeof *env);
	argv[argc] = NULL;
	env[env_count] = NULL;
	environ = env;
	attempt_dir = argv[1];
	if (chdir(strings[0]) != 0) {
		char reason[PATH_MAX + 64];
		snprintf(reason, sizeof reason, "cannot enter %s: %s", strings[0], strerror(errno));
		finish("failed", reason);
	}
	exit(supervise((int)argc, argv));
}

static int serve(int sock) {
	signal(SIGTERM, SIG_IGN);
	signal(SIGINT, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
	signal(SIGCHLD, SIG_DFL); /* reaped here, so that a supervisor's pid stays its own */
	for (;;) {
		struct pollfd wait_for = {.fd = sock, .events = POLLIN};
		/* Supervisors that ended are reaped within a second: until then each is a zombie,
		 * which the agent takes for ended (agents/runtime/process.py, proc_start_ticks). */
		int ready = poll(&wait_for, 1, 1000);
		reap();
		if (ready < 0 && errno != EINTR)
			return 1;
		if (ready <= 0)
			continue;
		char control[CMSG_SPACE(sizeof(int) * REQUEST_FDS)];
		struct iovec io = {.iov_base = request, .iov_len = MAX_REQUEST};
		struct msghdr message = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = control,
		                         .msg_controllen = sizeof control};
		ssize_t length = recvmsg(sock, &message, MSG_CMSG_CLOEXEC);
		if (length < 0 && errno == EINTR)
			continue;
		if (length <= 0)
			return length < 0; /* the agent is gone: so is its server */
		int fds[REQUEST_FDS], got = 0;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&message); c; c = CMSG_NXTHDR(&message, c))
			if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
				int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
				for (int i = 0; i < n; i++) {
					int fd;
					memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
					if (got < REQUEST_FDS)
						fds[got++] = fd;
					else
						close(fd);
				}
			}
		if (got != REQUEST_FDS || (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
			for (int i = 0; i < got; i++)
				close(fds[i]);
			answer(sock, "error a request the supervisor server cannot read\n");
			continue;
		}
		request[length] = '\0';
		pid_t pid = fork();
		if (pid == 0)
			serve_one(sock, fds, request, (size_t)length);
		for (int i = 0; i < REQUEST_FDS; i++)
			close(fds[i]);
		char line[128];
		if (pid < 0)
			snprintf(line, sizeof line, "error cannot fork: %s\n", strerror(errno));
		else
			snprintf(line, sizeof line, "%d %lld\n", (int)pid, start_ticks(pid));
		answer(sock, line);
	}
}

int main(int argc, char **argv) {
	if (argc == 3 && strcmp(argv[1], "--serve") == 0) {
		long long sock = digits(argv[2]);
		if (sock < 0 || sock > INT_MAX) {
			fprintf(stderr, "%s: --serve needs the socket's descriptor\n", argv[0]);
			return 2;
		}
		return serve((int)sock);
	}
	return supervise(argc, argv);
}
