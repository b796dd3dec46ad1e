#include <stdio.h>
#include <stdlib.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>
#include <string.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(int argc,char**argv){ const char*d=argv[1]; int n=atoi(argv[2]); char buf[16384]; memset(buf,'a',sizeof buf);
 double to=0,tw=0,ts=0,tc=0,tu=0; char p[4096];
 for(int i=0;i<n;i++){ snprintf(p,sizeof p,"%s/w%d",d,i); double a=now(); int fd=open(p,O_CREAT|O_WRONLY|O_TRUNC,0644); double b=now(); write(fd,buf,sizeof buf); double c=now(); fsync(fd); double e=now(); close(fd); double f=now(); unlink(p); double g=now();
  to+=b-a; tw+=c-b; ts+=e-c; tc+=f-e; tu+=g-f;}
 printf("open %.0f write %.0f fsync %.0f close %.0f unlink %.0f us\n",to/n,tw/n,ts/n,tc/n,tu/n); }
