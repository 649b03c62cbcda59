/* sandbox_probe: run a command the way dsv4@.service's daemon starts SGLang, on a machine
 * with no systemd (the GPU device machine), to prove that CUDA works under the unit's sandbox.
 *
 * What systemd applies to the service is inherited by every child the daemon forks (seccomp
 * filters, the capability bounding set, no_new_privs and the mount namespace pass through fork
 * and exec), so this program applies the same, in the same order systemd does, then switches
 * to the server's user the way the daemon's spawn does (setgroups = initgroups, setgid,
 * setuid), then execs the command:
 *
 *   --mounts        the unit's mount-namespace settings: ProtectSystem=strict (all read-only but
 *                   /dev, /proc, /sys and the writable paths), ProtectHome=read-only,
 *                   PrivateTmp=yes, ProtectKernelTunables (/proc/sys, /sys read-only),
 *                   ProtectControlGroups (/sys/fs/cgroup read-only), ProtectProc=invisible
 *                   (a new /proc with hidepid=invisible), ProtectHostname (a new UTS ns);
 *                   writable: the paths given with --rw (RuntimeDirectory=, CacheDirectory=)
 *   --caps LIST     CapabilityBoundingSet=: every capability not in LIST is dropped
 *   NoNewPrivileges=yes                           prctl(PR_SET_NO_NEW_PRIVS)
 *   --syscalls FILE SystemCallFilter= allow-list (names, one a line, as systemd-analyze
 *                   syscall-filter expands the unit's groups), SystemCallErrorNumber=EPERM,
 *                   SystemCallArchitectures=native; plus RestrictNamespaces=yes (unshare,
 *                   setns, clone with CLONE_NEW* -> EPERM, clone3 -> ENOSYS so libc falls
 *                   back to clone, as systemd does), RestrictRealtime=yes (SCHED_FIFO, SCHED_RR
 *                   refused), LockPersonality=yes (personality() only to PER_LINUX or a query)
 *   --user NAME     the server's user, with its gid and supplementary groups
 *
 * Each step prints one line ("ok: ..." or "skip: ... (why)"); the command's own output follows.
 * Build (static, so it runs whatever the device's libc): see bench/device/sandbox_check.py.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <sched.h>
#include <seccomp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/personality.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif
#ifndef CLONE_NEWCGROUP
#define CLONE_NEWCGROUP 0x02000000
#endif

static const unsigned long NS_FLAGS[] = {CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER,
                                         CLONE_NEWPID, CLONE_NEWNET, CLONE_NEWCGROUP, CLONE_NEWTIME};

static int fail(const char *what) {
    fprintf(stderr, "sandbox_probe: %s: %s\n", what, strerror(errno));
    return 127;
}

static int remount_ro(const char *path) {
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) != 0) return -1;
    return mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC, NULL);
}

static int rw_again(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0 && mkdir(path, 0755) != 0) return -1;
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) != 0) return -1;
    return mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_REC, NULL);
}

static void mounts(char **rw, int nrw) {
    /* the writable paths are prepared before / goes read-only */
    for (int i = 0; i < nrw; i++) mkdir(rw[i], 0755);
    if (unshare(CLONE_NEWNS | CLONE_NEWUTS) != 0) {
        printf("skip: mount and UTS namespaces (%s): ProtectSystem/ProtectHome/PrivateTmp/ProtectKernelTunables/"
               "ProtectControlGroups/ProtectProc/ProtectHostname not applied\n", strerror(errno));
        return;
    }
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) { printf("skip: make / private (%s)\n", strerror(errno)); return; }
    /* PrivateTmp=yes: fresh /tmp and /var/tmp, before / goes read-only */
    int tmp_ok = mount("tmpfs", "/tmp", "tmpfs", 0, "mode=1777") == 0;
    mount("tmpfs", "/var/tmp", "tmpfs", 0, "mode=1777");
    /* ProtectSystem=strict: everything read-only, then /dev and the writable paths again */
    if (remount_ro("/") != 0) { printf("skip: ProtectSystem=strict (%s)\n", strerror(errno)); return; }
    int dev_ok = rw_again("/dev") == 0;
    if (tmp_ok) { rw_again("/tmp"); rw_again("/var/tmp"); }
    for (int i = 0; i < nrw; i++)
        if (rw_again(rw[i]) != 0) printf("skip: ReadWritePaths=%s (%s)\n", rw[i], strerror(errno));
    /* ProtectHome=read-only: already, by the strict remount of / */
    /* ProtectKernelTunables, ProtectControlGroups: /proc/sys and /sys (with /sys/fs/cgroup) read-only: done by
       the remount of / where they are not separate mounts; separate ones are remounted here */
    remount_ro("/proc/sys");
    remount_ro("/sys");
    /* ProtectProc=invisible: a new /proc instance, other users' processes hidden */
    int proc_ok = mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=invisible") == 0;
    printf("ok: ProtectSystem=strict ProtectHome=read-only ProtectKernelTunables ProtectControlGroups%s%s%s; "
           "ProtectHostname (own UTS namespace)\n",
           tmp_ok ? " PrivateTmp" : " (PrivateTmp skipped)", dev_ok ? "" : " (/dev left read-only!)",
           proc_ok ? " ProtectProc=invisible" : " (ProtectProc skipped)");
    sethostname("sandboxed", 9);
}

static int caps(const char *list) {
    int last = 40;
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "r");
    if (f) { if (fscanf(f, "%d", &last) != 1) last = 40; fclose(f); }
    int kept = 0;
    for (int c = 0; c <= last; c++) {
        char name[64];
        snprintf(name, sizeof name, ",%d,", c);
        if (strstr(list, name)) { kept++; continue; }
        if (prctl(PR_CAPBSET_DROP, c, 0, 0, 0) != 0 && errno != EINVAL) return fail("PR_CAPBSET_DROP");
    }
    printf("ok: CapabilityBoundingSet: %d of %d capabilities kept\n", kept, last + 1);
    return 0;
}

static int filter(const char *file) {
    scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ERRNO(EPERM));
    if (!ctx) return fail("seccomp_init");
    seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0); /* no_new_privs is set by us, explicitly */
    FILE *f = fopen(file, "r");
    if (!f) return fail(file);
    char line[128];
    int allowed = 0, unknown = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0]) continue;
        if (!strcmp(line, "clone3") || !strcmp(line, "unshare") || !strcmp(line, "setns") || !strcmp(line, "clone") ||
            !strcmp(line, "sched_setscheduler") || !strcmp(line, "sched_setattr") || !strcmp(line, "personality"))
            continue; /* argument-filtered below */
        int nr = seccomp_syscall_resolve_name(line);
        if (nr == __NR_SCMP_ERROR) { unknown++; continue; }
        if (seccomp_rule_add(ctx, SCMP_ACT_ALLOW, nr, 0) == 0) allowed++;
    }
    fclose(f);
    /* RestrictNamespaces=yes */
    seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0);
    unsigned long all = 0;
    for (size_t i = 0; i < sizeof NS_FLAGS / sizeof *NS_FLAGS; i++) all |= NS_FLAGS[i];
    seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(clone), 1, SCMP_A0(SCMP_CMP_MASKED_EQ, all, 0));
    /* unshare(0) is harmless; anything with a namespace flag is refused (the default action) */
    seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(unshare), 1, SCMP_A0(SCMP_CMP_MASKED_EQ, all, 0));
    /* RestrictRealtime=yes: SCHED_OTHER, SCHED_BATCH, SCHED_IDLE only */
    for (int policy = 0; policy <= 5; policy++)
        if (policy != SCHED_FIFO && policy != SCHED_RR && policy != 4 /* unused */)
            seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(sched_setscheduler), 1, SCMP_A1(SCMP_CMP_EQ, policy));
    seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(sched_setattr), 0); /* attr in memory: systemd cannot check it either */
    /* LockPersonality=yes */
    seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(personality), 1, SCMP_A0(SCMP_CMP_EQ, PER_LINUX));
    seccomp_rule_add(ctx, SCMP_ACT_ALLOW, SCMP_SYS(personality), 1, SCMP_A0(SCMP_CMP_EQ, 0xffffffff));
    if (seccomp_load(ctx) != 0) return fail("seccomp_load");
    printf("ok: SystemCallFilter: %d system calls allowed (%d names unknown to this kernel's libseccomp), "
           "EPERM otherwise; RestrictNamespaces RestrictRealtime LockPersonality\n", allowed, unknown);
    seccomp_release(ctx);
    return 0;
}

/* getpwnam() and initgroups() need the NSS modules of the glibc this was linked with, which a
 * static binary cannot bring to another machine: read /etc/passwd and /etc/group directly. */
struct account { char name[64], home[256]; uid_t uid; gid_t gid; gid_t groups[64]; int ngroups; };

static int find_account(const char *user, struct account *a) {
    FILE *f = fopen("/etc/passwd", "r");
    char line[1024];
    int found = 0;
    if (!f) return 0;
    while (!found && fgets(line, sizeof line, f)) {
        char *fields[7] = {0}, *save = NULL, *p = line;
        for (int k = 0; k < 7 && (fields[k] = strsep(&p, ":")); k++) (void)save;
        if (fields[0] && fields[5] && !strcmp(fields[0], user)) {
            snprintf(a->name, sizeof a->name, "%s", fields[0]);
            a->uid = (uid_t)atol(fields[2]);
            a->gid = (gid_t)atol(fields[3]);
            snprintf(a->home, sizeof a->home, "%s", fields[5]);
            found = 1;
        }
    }
    fclose(f);
    if (!found) return 0;
    a->groups[0] = a->gid;
    a->ngroups = 1;
    f = fopen("/etc/group", "r");
    while (f && fgets(line, sizeof line, f) && a->ngroups < 64) {
        line[strcspn(line, "\r\n")] = 0;
        char *p = line, *name = strsep(&p, ":"), *pass = strsep(&p, ":"), *gid = strsep(&p, ":"), *members = p;
        (void)name; (void)pass;
        for (char *m; members && (m = strsep(&members, ","));)
            if (gid && !strcmp(m, user)) { a->groups[a->ngroups++] = (gid_t)atol(gid); break; }
    }
    if (f) fclose(f);
    return 1;
}

int main(int argc, char **argv) {
    const char *syscalls = NULL, *user = NULL, *keep = NULL;
    int do_mounts = 0, i = 1;
    char *rw[16];
    int nrw = 0;
    for (; i < argc && strcmp(argv[i], "--"); i++) {
        if (!strcmp(argv[i], "--syscalls") && i + 1 < argc) syscalls = argv[++i];
        else if (!strcmp(argv[i], "--user") && i + 1 < argc) user = argv[++i];
        else if (!strcmp(argv[i], "--caps") && i + 1 < argc) keep = argv[++i];
        else if (!strcmp(argv[i], "--rw") && i + 1 < argc && nrw < 16) rw[nrw++] = argv[++i];
        else if (!strcmp(argv[i], "--mounts")) do_mounts = 1;
        else { fprintf(stderr, "sandbox_probe: unknown argument %s\n", argv[i]); return 2; }
    }
    if (i + 1 >= argc) { fprintf(stderr, "usage: sandbox_probe [--mounts] [--rw PATH]... [--caps ,N,N,] "
                                         "[--syscalls FILE] [--user NAME] -- COMMAND...\n"); return 2; }
    struct account acct, *pw = NULL;
    if (user) {
        if (!find_account(user, &acct)) { fprintf(stderr, "sandbox_probe: no user %s in /etc/passwd\n", user); return 2; }
        pw = &acct;
    }
    if (do_mounts) mounts(rw, nrw);
    if (keep && caps(keep)) return 127;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return fail("PR_SET_NO_NEW_PRIVS");
    printf("ok: NoNewPrivileges\n");
    if (syscalls && filter(syscalls)) return 127;
    if (pw) { /* what the daemon's spawn does after the fork: initgroups, setgid, setuid */
        if (setgroups(pw->ngroups, pw->groups) != 0) return fail("setgroups");
        if (setgid(pw->gid) != 0) return fail("setgid");
        if (setuid(pw->uid) != 0) return fail("setuid");
        setenv("HOME", pw->home, 1);
        setenv("USER", pw->name, 1);
        setenv("LOGNAME", pw->name, 1);
        printf("ok: running as %s (uid %d, gid %d, %d group(s))\n", pw->name, (int)pw->uid, (int)pw->gid, pw->ngroups);
    }
    fflush(stdout);
    execvp(argv[i + 1], argv + i + 1);
    return fail(argv[i + 1]);
}
